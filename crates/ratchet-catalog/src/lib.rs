//! The agent catalog: a directory of Markdown files, each one agent's definition (strict YAML
//! frontmatter, then the system prompt), loaded whole or rejected whole with every problem
//! found in it.

mod catalog;
mod definition;
mod file;

use std::fmt;
use std::path::PathBuf;

pub use catalog::{Catalog, MAX_FILE_BYTES};
pub use definition::{AgentDefinition, AgentLimits, MAX_SIGNAL_BYTES};

/// What the runtime loading a catalog offers; definitions may only name these.
pub trait Known {
    /// Ok when the runtime offers this tool; Err(why) otherwise (the message lists what is known).
    fn tool(&self, name: &str) -> Result<(), String>;
    /// Ok when this model spec can be frozen into a run (the scripted file, if any, already resolved to an absolute path).
    fn model(&self, spec: &str) -> Result<(), String>;
}

/// One reason a catalog was rejected, where it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based, when the problem has a line.
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

#[cfg(test)]
mod tests;
