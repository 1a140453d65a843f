//! Resolves a run's frozen model (a scripted spec, or a provider's settings) to a model
//! instance, once per model per process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ratchet_core::RunConfigSnapshot;
use ratchet_llm::Model;

/// Reads a secret (an API key) by the name of the environment variable that holds it.
pub type Secrets = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

pub struct Models {
    known_tools: Vec<String>,
    secrets: Secrets,
    /// Models the embedding program implements, by spec; they win over everything else.
    registered: Mutex<HashMap<String, Arc<dyn Model>>>,
    cache: Mutex<HashMap<String, Arc<dyn Model>>>,
}

impl Models {
    /// Keys are read from the process environment.
    pub fn new(known_tools: Vec<String>) -> Models {
        Models::with_secrets(known_tools, Arc::new(|name| std::env::var(name).ok()))
    }

    /// `known_tools` are the registry's; the tools the runtime injects (`delegate`,
    /// `agent_task`, `emit_signal`) are known too, so that a script may call them.
    pub fn with_secrets(mut known_tools: Vec<String>, secrets: Secrets) -> Models {
        use ratchet_core::delegation::{AGENT_TASK_TOOL, DELEGATE_TOOL, EMIT_SIGNAL_TOOL};
        known_tools.extend([DELEGATE_TOOL, AGENT_TASK_TOOL, EMIT_SIGNAL_TOOL].map(str::to_owned));
        Models {
            known_tools,
            secrets,
            registered: Mutex::new(HashMap::new()),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Makes `model` the one runs whose spec is `spec` use: a model the embedding program
    /// implements itself.
    pub fn register(&self, spec: &str, model: Arc<dyn Model>) {
        if let Ok(mut registered) = self.registered.lock() {
            registered.insert(spec.to_owned(), model);
        }
    }

    /// Whether `spec` names a model the embedding program registered.
    pub fn is_registered(&self, spec: &str) -> bool {
        self.registered(spec).is_some()
    }

    fn registered(&self, spec: &str) -> Option<Arc<dyn Model>> {
        self.registered.lock().ok()?.get(spec).cloned()
    }

    /// The model of a run's frozen configuration: its provider settings when it has them,
    /// else its spec (a scripted model's file is read and its tools checked).
    pub fn for_config(&self, config: &RunConfigSnapshot) -> ratchet_llm::Result<Arc<dyn Model>> {
        if let Some(model) = self.registered(&config.model) {
            return Ok(model);
        }
        let Some(settings) = &config.model_settings else {
            return self.resolve(&config.model);
        };
        let key = serde_json::to_string(settings).unwrap_or_else(|_| config.model.clone());
        self.cached(&key, || {
            let api_key = settings
                .api_key_env
                .as_deref()
                .and_then(|name| (self.secrets)(name));
            ratchet_llm::from_settings(settings, api_key)
        })
    }

    /// Parses and checks a spec (a scripted model's file is read and its tools checked).
    pub fn resolve(&self, spec: &str) -> ratchet_llm::Result<Arc<dyn Model>> {
        if let Some(model) = self.registered(spec) {
            return Ok(model);
        }
        self.cached(spec, || {
            let known: Vec<&str> = self.known_tools.iter().map(String::as_str).collect();
            ratchet_llm::from_spec(spec, &known)
        })
    }

    fn cached(
        &self,
        key: &str,
        build: impl FnOnce() -> ratchet_llm::Result<Arc<dyn Model>>,
    ) -> ratchet_llm::Result<Arc<dyn Model>> {
        if let Some(model) = self.cache.lock().ok().and_then(|c| c.get(key).cloned()) {
            return Ok(model);
        }
        let model = build()?;
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(key.to_owned(), Arc::clone(&model));
        }
        Ok(model)
    }
}
