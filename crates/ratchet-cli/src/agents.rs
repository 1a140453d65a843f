//! `ratchet agents check DIR`: loads a catalog against the tools and models this process would
//! offer (the configuration's MCP servers and model profiles included) and prints its agents
//! or every problem that rejects it.

use std::path::Path;
use std::process::ExitCode;

use ratchet::Config;
use ratchet_catalog::Catalog;

use crate::serve;

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
