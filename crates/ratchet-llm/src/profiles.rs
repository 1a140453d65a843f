//! Model profiles: the `[models.NAME]` tables of `ratchet.toml`, and how a model spec —
//! `scripted:FILE`, `openai:MODEL`, `anthropic:MODEL` or a profile's name — becomes the
//! settings a run is frozen with.

use std::collections::BTreeMap;

use ratchet_core::{ModelSettings, Prices};
use serde::Deserialize;

use crate::Error;

const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_READ_TIMEOUT_MS: u64 = 120_000;
const DEFAULT_MAX_RETRIES: u32 = 3;

/// One `[models.NAME]` table. Everything but `provider` and `model` has a default.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// `openai` (chat completions: OpenAI, vLLM, llama.cpp, Ollama, LM Studio, OpenRouter…)
    /// or `anthropic` (Messages).
    pub provider: String,
    pub model: String,
    /// Default: `OPENAI_BASE_URL` or `https://api.openai.com/v1`; `ANTHROPIC_BASE_URL` or
    /// `https://api.anthropic.com`.
    pub base_url: Option<String>,
    /// The environment variable holding the key. Default: `OPENAI_API_KEY` /
    /// `ANTHROPIC_API_KEY`, used only when set (local servers need none); a variable named
    /// here must be set.
    pub api_key_env: Option<String>,
    pub connect_timeout_ms: Option<u64>,
    pub read_timeout_ms: Option<u64>,
    /// Tries after the first before a run fails with `llm_error` (default 3), each after a
    /// backoff with jitter or the provider's `Retry-After`.
    pub max_retries: Option<u32>,
    /// Stream answers (default true); false for servers that cannot.
    pub stream: Option<bool>,
    pub max_output_tokens: Option<u32>,
    /// US dollars per million tokens, for cost accounting.
    pub prices: Option<Prices>,
}

/// What a spec resolves to: the settings to freeze (None for a scripted model) and the
/// attempts a model call gets.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub settings: Option<ModelSettings>,
    pub max_attempts: Option<u32>,
}

/// Resolves a model spec against the profiles. `env` reads the process environment (base URL
/// defaults, and whether a named key variable is set).
pub fn resolve_spec(
    spec: &str,
    profiles: &BTreeMap<String, Profile>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Resolved, Error> {
    let bad = |reason: String| Error::Spec {
        spec: spec.to_owned(),
        reason,
    };
    let profile = match spec.split_once(':') {
        Some(("scripted", _)) => {
            return Ok(Resolved {
                settings: None,
                max_attempts: None,
            });
        }
        Some((provider @ ("openai" | "anthropic"), model)) if !model.is_empty() => Profile {
            provider: provider.to_owned(),
            model: model.to_owned(),
            base_url: None,
            api_key_env: None,
            connect_timeout_ms: None,
            read_timeout_ms: None,
            max_retries: None,
            stream: None,
            max_output_tokens: None,
            prices: None,
        },
        Some((kind, _)) => {
            return Err(bad(format!(
                "expected scripted:FILE, openai:MODEL, anthropic:MODEL or a profile name; {kind:?} is none of them"
            )));
        }
        None => profiles.get(spec).cloned().ok_or_else(|| {
            let names: Vec<&str> = profiles.keys().map(String::as_str).collect();
            bad(format!(
                "no model profile {spec:?}; profiles: {}",
                if names.is_empty() {
                    "none configured".to_owned()
                } else {
                    names.join(", ")
                }
            ))
        })?,
    };
    let settings = settings_of(&profile, env).map_err(bad)?;
    Ok(Resolved {
        settings: Some(settings),
        max_attempts: Some(profile.max_retries.unwrap_or(DEFAULT_MAX_RETRIES) + 1),
    })
}

/// Checks every profile (so a typo is found at start, not at a run's first call).
pub fn check_profiles(
    profiles: &BTreeMap<String, Profile>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), Error> {
    for (name, profile) in profiles {
        settings_of(profile, env).map_err(|reason| Error::Spec {
            spec: name.clone(),
            reason,
        })?;
    }
    Ok(())
}

fn settings_of(
    profile: &Profile,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ModelSettings, String> {
    let (base_env, base_default, key_env) = match profile.provider.as_str() {
        "openai" => (
            "OPENAI_BASE_URL",
            "https://api.openai.com/v1",
            "OPENAI_API_KEY",
        ),
        "anthropic" => (
            "ANTHROPIC_BASE_URL",
            "https://api.anthropic.com",
            "ANTHROPIC_API_KEY",
        ),
        other => {
            return Err(format!(
                "unknown provider {other:?}; expected openai or anthropic"
            ));
        }
    };
    if profile.model.trim().is_empty() {
        return Err("`model` is empty; expected the provider's model name".into());
    }
    let base_url = (profile.base_url.clone())
        .or_else(|| env(base_env))
        .unwrap_or_else(|| base_default.to_owned());
    let scheme_ok = base_url.starts_with("http://") || base_url.starts_with("https://");
    if !scheme_ok {
        return Err(format!(
            "base_url {base_url:?} is not an http:// or https:// URL"
        ));
    }
    let api_key_env = match &profile.api_key_env {
        Some(name) if env(name).is_none_or(|v| v.is_empty()) => {
            return Err(format!("environment variable {name} is not set"));
        }
        Some(name) => Some(name.clone()),
        None => Some(key_env.to_owned()),
    };
    if let Some(prices) = profile.prices {
        let valid = |p: f64| p.is_finite() && p >= 0.0;
        if !prices.all().all(valid) {
            return Err("prices must be finite and not negative".into());
        }
    }
    Ok(ModelSettings {
        provider: profile.provider.clone(),
        base_url: base_url.trim_end_matches('/').to_owned(),
        model: profile.model.clone(),
        api_key_env,
        connect_timeout_ms: (profile.connect_timeout_ms).unwrap_or(DEFAULT_CONNECT_TIMEOUT_MS),
        read_timeout_ms: profile.read_timeout_ms.unwrap_or(DEFAULT_READ_TIMEOUT_MS),
        stream: profile.stream.unwrap_or(true),
        max_output_tokens: profile.max_output_tokens,
        prices: profile.prices,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn env(key: &str) -> Option<String> {
        match key {
            "OPENAI_BASE_URL" => Some("http://127.0.0.1:8080/v1/".into()),
            "MY_KEY" => Some("secret".into()),
            _ => None,
        }
    }

    /// Profiles arrive from TOML in the binary; JSON builds the same struct here.
    fn profile(json: &str) -> Profile {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn provider_specs_take_their_defaults_from_the_environment() {
        let none = BTreeMap::new();
        let openai = resolve_spec("openai:gpt-4o-mini", &none, &env).unwrap();
        let settings = openai.settings.unwrap();
        assert_eq!(settings.base_url, "http://127.0.0.1:8080/v1");
        assert_eq!(settings.model, "gpt-4o-mini");
        assert_eq!(settings.api_key_env.as_deref(), Some("OPENAI_API_KEY"));
        assert!(settings.stream);
        assert_eq!(openai.max_attempts, Some(4));
        let anthropic = resolve_spec("anthropic:claude-x", &none, &env).unwrap();
        let settings = anthropic.settings.unwrap();
        assert_eq!(settings.base_url, "https://api.anthropic.com");
        assert_eq!(settings.api_key_env.as_deref(), Some("ANTHROPIC_API_KEY"));
        let scripted = resolve_spec("scripted:demo", &none, &env).unwrap();
        assert_eq!(scripted.settings, None);
    }

    #[test]
    fn a_profile_is_found_by_name_and_checked() {
        let mut profiles = BTreeMap::new();
        profiles.insert(
            "fast".to_owned(),
            profile(
                r#"{"provider": "openai", "model": "m", "base_url": "http://h:1/v1",
                    "api_key_env": "MY_KEY", "max_retries": 0, "stream": false,
                    "prices": {"input_per_mtok": 0.5, "output_per_mtok": 2.0}}"#,
            ),
        );
        let fast = resolve_spec("fast", &profiles, &env).unwrap();
        let settings = fast.settings.unwrap();
        assert_eq!(
            (settings.base_url.as_str(), settings.stream),
            ("http://h:1/v1", false)
        );
        assert_eq!(fast.max_attempts, Some(1));
        assert!(check_profiles(&profiles, &env).is_ok());

        let missing = resolve_spec("slow", &profiles, &env)
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("no model profile \"slow\"") && missing.contains("fast"),
            "{missing}"
        );
        let kind = resolve_spec("gemini:x", &profiles, &env)
            .unwrap_err()
            .to_string();
        assert!(kind.contains("openai:MODEL"), "{kind}");
        for (json, expected) in [
            (
                r#"{"provider": "cohere", "model": "m"}"#,
                "unknown provider \"cohere\"",
            ),
            (
                r#"{"provider": "openai", "model": " "}"#,
                "`model` is empty",
            ),
            (
                r#"{"provider": "openai", "model": "m", "base_url": "ftp://x"}"#,
                "not an http",
            ),
            (
                r#"{"provider": "openai", "model": "m", "api_key_env": "NOPE"}"#,
                "NOPE is not set",
            ),
            (
                r#"{"provider": "openai", "model": "m", "prices": {"input_per_mtok": -1, "output_per_mtok": 1}}"#,
                "not negative",
            ),
        ] {
            let mut bad = BTreeMap::new();
            bad.insert("p".to_owned(), profile(json));
            let error = check_profiles(&bad, &env).unwrap_err().to_string();
            assert!(error.contains(expected), "{json}: {error}");
        }
        let unknown: Result<Profile, _> =
            serde_json::from_str(r#"{"provider": "openai", "model": "m", "modle": "x"}"#);
        assert!(unknown.is_err(), "unknown keys are refused");
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// A profile as `ratchet.toml` could hold it, valid or not.
    fn any_profile() -> impl Strategy<Value = Profile> {
        let provider = prop_oneof![
            Just("openai".to_owned()),
            Just("anthropic".to_owned()),
            any::<String>()
        ];
        let base_url = prop_oneof![
            "https?://[a-z0-9.:]{1,20}(/[a-z0-9]{0,5}){0,2}/?",
            any::<String>(),
        ];
        let price = prop_oneof![0.0f64..1000.0, any::<f64>()];
        (
            (provider, any::<String>(), proptest::option::of(base_url)),
            (
                proptest::option::of(prop_oneof![
                    Just("MY_KEY".to_owned()),
                    Just("UNSET".to_owned())
                ]),
                proptest::option::of(any::<u64>()),
                proptest::option::of(any::<u64>()),
                proptest::option::of(0u32..1000),
                proptest::option::of(any::<bool>()),
                proptest::option::of(any::<u32>()),
                proptest::option::of((price.clone(), price)),
            ),
        )
            .prop_map(
                |(
                    (provider, model, base_url),
                    (api_key_env, connect, read, retries, stream, max_out, prices),
                )| Profile {
                    provider,
                    model,
                    base_url,
                    api_key_env,
                    connect_timeout_ms: connect,
                    read_timeout_ms: read,
                    max_retries: retries,
                    stream,
                    max_output_tokens: max_out,
                    prices: prices.map(|(input_per_mtok, output_per_mtok)| Prices {
                        input_per_mtok,
                        output_per_mtok,
                        ..Prices::default()
                    }),
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any spec resolves or says why; `scripted:…` needs no settings, `openai:MODEL` and
        /// `anthropic:MODEL` get the provider's defaults for exactly that model.
        #[test]
        fn any_spec_resolves_to_what_it_names_or_says_why(
            spec in prop_oneof![
                any::<String>(),
                ("(scripted|openai|anthropic|gemini|)", any::<String>()).prop_map(|(kind, rest)| format!("{kind}:{rest}")),
            ],
        ) {
            let resolved = resolve_spec(&spec, &BTreeMap::new(), &no_env);
            match spec.split_once(':') {
                Some(("scripted", _)) => prop_assert_eq!(resolved.unwrap(), Resolved { settings: None, max_attempts: None }),
                Some((provider @ ("openai" | "anthropic"), model)) if !model.trim().is_empty() => {
                    let settings = resolved.unwrap().settings.unwrap();
                    prop_assert_eq!(settings.provider.as_str(), provider);
                    prop_assert_eq!(settings.model.as_str(), model);
                    let base_url = if provider == "openai" { "https://api.openai.com/v1" } else { "https://api.anthropic.com" };
                    prop_assert_eq!(settings.base_url.as_str(), base_url);
                }
                _ => {
                    let error = resolved.unwrap_err();
                    let Error::Spec { spec: named, reason } = &error else {
                        panic!("not a spec error: {error:?}");
                    };
                    prop_assert_eq!(named, &spec);
                    prop_assert!(!reason.trim().is_empty());
                }
            }
        }

        /// A profile is checked at start: either it is refused with a reason, or resolving its
        /// name gives settings that say what the profile says.
        #[test]
        fn a_profile_is_refused_with_a_reason_or_means_what_it_says(profile in any_profile()) {
            let profiles = BTreeMap::from([("p".to_owned(), profile.clone())]);
            match check_profiles(&profiles, &env) {
                Err(Error::Spec { spec, reason }) => {
                    prop_assert_eq!(spec, "p");
                    prop_assert!(!reason.trim().is_empty());
                    prop_assert!(resolve_spec("p", &profiles, &env).is_err(), "resolving agrees with the check");
                }
                Err(other) => prop_assert!(false, "not a spec error: {:?}", other),
                Ok(()) => {
                    let resolved = resolve_spec("p", &profiles, &env).unwrap();
                    let settings = resolved.settings.unwrap();
                    prop_assert!(["openai", "anthropic"].contains(&settings.provider.as_str()));
                    prop_assert_eq!(&settings.provider, &profile.provider);
                    prop_assert_eq!(&settings.model, &profile.model);
                    prop_assert!(!settings.model.trim().is_empty());
                    prop_assert!(settings.base_url.starts_with("http://") || settings.base_url.starts_with("https://"));
                    if let Some(base_url) = &profile.base_url {
                        prop_assert_eq!(settings.base_url.as_str(), base_url.trim_end_matches('/'));
                    }
                    prop_assert_eq!(settings.connect_timeout_ms, profile.connect_timeout_ms.unwrap_or(DEFAULT_CONNECT_TIMEOUT_MS));
                    prop_assert_eq!(settings.read_timeout_ms, profile.read_timeout_ms.unwrap_or(DEFAULT_READ_TIMEOUT_MS));
                    prop_assert_eq!(settings.stream, profile.stream.unwrap_or(true));
                    prop_assert_eq!(settings.max_output_tokens, profile.max_output_tokens);
                    prop_assert_eq!(settings.prices, profile.prices);
                    prop_assert_eq!(resolved.max_attempts, Some(profile.max_retries.unwrap_or(DEFAULT_MAX_RETRIES) + 1));
                    if let Some(key) = &profile.api_key_env {
                        prop_assert!(env(key).is_some(), "a named key variable must be set");
                    }
                }
            }
        }
    }
}
