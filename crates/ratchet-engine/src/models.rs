//! Resolves a run's frozen model spec to a model instance, once per spec per process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ratchet_llm::Model;

pub struct Models {
    known_tools: Vec<String>,
    cache: Mutex<HashMap<String, Arc<dyn Model>>>,
}

impl Models {
    pub fn new(known_tools: Vec<String>) -> Models {
        Models {
            known_tools,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Makes `model` the one runs whose spec is `spec` use: a model the embedding program
    /// implements itself.
    pub fn register(&self, spec: &str, model: Arc<dyn Model>) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(spec.to_owned(), model);
        }
    }

    /// Parses and checks a spec (a scripted model's file is read and its tools checked).
    pub fn resolve(&self, spec: &str) -> ratchet_llm::Result<Arc<dyn Model>> {
        if let Some(model) = self.cache.lock().ok().and_then(|c| c.get(spec).cloned()) {
            return Ok(model);
        }
        let known: Vec<&str> = self.known_tools.iter().map(String::as_str).collect();
        let model = ratchet_llm::from_spec(spec, &known)?;
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(spec.to_owned(), Arc::clone(&model));
        }
        Ok(model)
    }
}
