//! `ratchet agents check DIR`: loads an agent catalog against the tools and models this
//! process would offer (the configuration's MCP servers and model profiles included), and
//! prints its agents or every problem that rejects it.

use std::path::Path;
use std::process::ExitCode;

use ratchet_catalog::{Catalog, Known};
use ratchet_server::Config;

use crate::runtime::Toolbox;
use crate::serve;

impl Known for Toolbox {
    fn tool(&self, name: &str) -> Result<(), String> {
        let names = self.tools.names();
        if names.contains(&name) {
            Ok(())
        } else {
            Err(format!("the runtime's tools are {}", names.join(", ")))
        }
    }

    fn model(&self, spec: &str) -> Result<(), String> {
        self.resolve_model(spec)
            .map(|_| ())
            .map_err(|error| format!("{error:#}"))
    }
}

pub async fn check(dir: &Path, config: Option<&Path>) -> anyhow::Result<ExitCode> {
    let config = Config::load_or_default(config)?;
    let toolbox = serve::toolbox(&config).await?;
    let loaded = Catalog::load(dir, &toolbox);
    toolbox.close().await;
    match loaded {
        Ok(catalog) => {
            let width = catalog.agents().map(|a| a.id.len()).max().unwrap_or(0);
            for agent in catalog.agents() {
                // A description may span lines; each agent keeps to one.
                let description: Vec<&str> = agent.description.split_whitespace().collect();
                println!(
                    "{:width$}  {}  {}",
                    agent.id,
                    &agent.hash[..12],
                    description.join(" ")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(problems) => {
            for problem in &problems {
                eprintln!("{problem}");
            }
            let plural = if problems.len() == 1 { "" } else { "s" };
            eprintln!(
                "{} problem{plural}; the catalog was rejected",
                problems.len()
            );
            Ok(ExitCode::FAILURE)
        }
    }
}
