//! Tidy checks: the architecture's invariants that a grep can defend, run with the tests.
//! Each failure message says which rule broke and where.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

fn crates() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(workspace().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

/// The `[dependencies]` section of a crate's manifest (dev-dependencies excluded).
fn dependencies(krate: &str) -> Vec<String> {
    let manifest =
        std::fs::read_to_string(workspace().join("crates").join(krate).join("Cargo.toml")).unwrap();
    let mut in_deps = false;
    let mut deps = Vec::new();
    for line in manifest.lines() {
        if line.starts_with('[') {
            in_deps = line.trim() == "[dependencies]";
        } else if in_deps && let Some((name, _)) = line.split_once('=') {
            deps.push(name.trim().trim_end_matches(".workspace").to_owned());
        }
    }
    deps
}

#[test]
fn every_module_says_what_it_is_for() {
    for krate in crates() {
        for file in rust_files(&workspace().join("crates").join(&krate).join("src")) {
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(
                text.starts_with("//!"),
                "{} must start with a `//!` module doc",
                file.display()
            );
        }
    }
}

#[test]
fn the_core_does_no_io_no_async_and_reads_no_clock() {
    // `glob` for its pure pattern matcher only: its directory walker is forbidden below.
    // `sha2` derives trace and span ids from run ids (`trace.rs`): a pure function.
    let allowed = ["glob", "serde", "serde_json", "sha2", "thiserror"];
    for dep in dependencies("ratchet-core") {
        assert!(
            allowed.contains(&dep.as_str()),
            "ratchet-core must not depend on {dep}"
        );
    }
    let forbidden = [
        "tokio",
        "async fn",
        "std::fs",
        "std::net",
        "std::thread",
        "SystemTime",
        "Instant::now",
        "std::env",
        "glob::glob",
    ];
    for file in rust_files(&workspace().join("crates/ratchet-core/src")) {
        let text = std::fs::read_to_string(&file).unwrap();
        for word in forbidden {
            assert!(
                !text.contains(word),
                "{} uses {word:?}; the core stays pure",
                file.display()
            );
        }
    }
}

/// Plugins attach to the observation plane only: the dispatcher is written against the
/// store's `Deliveries` role, which has no method that could enqueue a job or change a run.
#[test]
fn the_webhook_dispatcher_only_observes() {
    for dep in dependencies("ratchet-webhooks") {
        assert!(
            ![
                "ratchet-engine",
                "ratchet-store-sql",
                "ratchet-sqlite",
                "ratchet-postgres"
            ]
            .contains(&dep.as_str()),
            "ratchet-webhooks must not depend on {dep}"
        );
    }
    for file in rust_files(&workspace().join("crates/ratchet-webhooks/src")) {
        let text = std::fs::read_to_string(&file).unwrap();
        let named = store_names(&text);
        assert!(
            named.iter().all(|name| !ROLES_THAT_WRITE.contains(name)),
            "{} names {named:?} of ratchet_store; the dispatcher holds the `Deliveries` role only",
            file.display()
        );
    }
}

/// What of `ratchet_store` hands out its transactions: the `Writes` role, the whole `Store`
/// (every role at once) and the `Roles` that carry them.
const ROLES_THAT_WRITE: [&str; 3] = ["Writes", "Store", "Roles"];

/// Only the Coordinator writes. Outside the store crates (the port, its backends and their
/// suite), the roles that write are named by the Coordinator, which holds `Writes`, and by
/// the assembly of a process (`ratchet`'s runtime), which opens a store and hands each part
/// its role — nowhere else. Everything else is given `Reads`, `WebhookAdmin` or
/// `Deliveries`, and asks the Coordinator to act. Tests drive stores directly and are
/// exempt.
#[test]
fn only_the_coordinator_writes() {
    let store_crates = [
        "ratchet-store",
        "ratchet-store-sql",
        "ratchet-sqlite",
        "ratchet-postgres",
        "ratchet-store-conformance",
        "ratchet-store-memory",
    ];
    let allowed = [
        "crates/ratchet-engine/src/coordinator.rs",
        "crates/ratchet/src/runtime.rs",
    ];
    for krate in crates() {
        if store_crates.contains(&krate.as_str()) {
            continue;
        }
        for file in rust_files(&workspace().join("crates").join(&krate).join("src")) {
            let relative = file.strip_prefix(workspace()).unwrap();
            if allowed.iter().any(|path| relative == Path::new(path)) {
                continue;
            }
            let text = std::fs::read_to_string(&file).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            let named: Vec<&str> = store_names(code)
                .into_iter()
                .filter(|name| ROLES_THAT_WRITE.contains(name))
                .collect();
            assert!(
                named.is_empty(),
                "{} names {named:?} of ratchet_store: only the Coordinator writes (see \
                 docs/ARCHITECTURE.md); read through `Coordinator::store()` and act through \
                 the Coordinator's methods",
                relative.display()
            );
        }
    }
}

/// The names `text` takes from `ratchet_store`: the last segment of each
/// `ratchet_store::Name` path and every name of a `ratchet_store::{…}` list.
fn store_names(text: &str) -> Vec<&str> {
    let mut names = Vec::new();
    for (at, prefix) in text.match_indices("ratchet_store::") {
        let rest = &text[at + prefix.len()..];
        let segment = if let Some(list) = rest.strip_prefix('{') {
            &list[..list.find('}').unwrap_or(list.len())]
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            &rest[..end]
        };
        names.extend(
            segment
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter_map(|path| path.rsplit("::").next())
                .filter(|name| !name.is_empty()),
        );
    }
    names
}

/// Whether `text` has `word` as a whole identifier (not inside `StoredEvent`, say).
fn whole_word(word: &'static str) -> impl Fn(&str) -> bool {
    move |text| {
        text.match_indices(word).any(|(at, _)| {
            let identifier = |c: char| c.is_alphanumeric() || c == '_';
            let before = text[..at].chars().next_back().is_some_and(identifier);
            let after = text[at + word.len()..]
                .chars()
                .next()
                .is_some_and(identifier);
            !before && !after
        })
    }
}

#[test]
fn crates_depend_only_along_the_layers() {
    let rules: &[(&str, &[&str])] = &[
        ("ratchet-core", &[]),
        ("ratchet-store", &["ratchet-core"]),
        // The suite every backend's tests run: the store's contract, nothing of a backend.
        (
            "ratchet-store-conformance",
            &["ratchet-core", "ratchet-store"],
        ),
        ("ratchet-llm", &["ratchet-core"]),
        ("ratchet-tools", &["ratchet-core"]),
        // Spans are made from the pure core's state; exporting them is the binary's.
        ("ratchet-telemetry", &["ratchet-core"]),
        ("ratchet-catalog", &["ratchet-core"]),
        ("ratchet-mcp", &["ratchet-core", "ratchet-tools"]),
        ("ratchet-store-sql", &["ratchet-core", "ratchet-store"]),
        // The reference model: the contract over plain collections, nothing of SQL.
        ("ratchet-store-memory", &["ratchet-core", "ratchet-store"]),
        (
            "ratchet-sqlite",
            &["ratchet-core", "ratchet-store", "ratchet-store-sql"],
        ),
        (
            "ratchet-postgres",
            &["ratchet-core", "ratchet-store", "ratchet-store-sql"],
        ),
        (
            "ratchet-engine",
            &[
                "ratchet-core",
                "ratchet-store",
                "ratchet-llm",
                "ratchet-tools",
                "ratchet-telemetry",
            ],
        ),
        ("ratchet-webhooks", &["ratchet-core", "ratchet-store"]),
        (
            "ratchet-server",
            &[
                "ratchet-core",
                "ratchet-store",
                "ratchet-llm",
                "ratchet-engine",
                "ratchet-webhooks",
            ],
        ),
        // The library a program embeds: it assembles every layer below the binary.
        (
            "ratchet",
            &[
                "ratchet-core",
                "ratchet-store",
                "ratchet-sqlite",
                "ratchet-postgres",
                "ratchet-llm",
                "ratchet-tools",
                "ratchet-catalog",
                "ratchet-mcp",
                "ratchet-engine",
                "ratchet-telemetry",
                "ratchet-webhooks",
                "ratchet-server",
            ],
        ),
        // The HTTP API's Rust client: the API's shapes, nothing of the server.
        ("ratchet-client", &["ratchet-core", "ratchet-llm"]),
        // The benchmarks: a program of their own over the library, never linked into `ratchet`.
        (
            "ratchet-bench",
            &[
                "ratchet",
                "ratchet-core",
                "ratchet-store",
                "ratchet-sqlite",
                "ratchet-engine",
                "ratchet-server",
                "ratchet-webhooks",
                "ratchet-client",
            ],
        ),
        // The chaos program sees what users and operators see: the HTTP API, the event
        // streams and the store's reads; never the engine.
        (
            "ratchet-chaos",
            &[
                "ratchet-core",
                "ratchet-store",
                "ratchet-sqlite",
                "ratchet-postgres",
                "ratchet-llm",
            ],
        ),
    ];
    for krate in crates() {
        let Some((_, allowed)) = rules.iter().find(|(name, _)| *name == krate) else {
            assert_eq!(
                krate, "ratchet-cli",
                "new crate {krate}: add its layer to this test and ARCHITECTURE.md"
            );
            continue;
        };
        for dep in dependencies(&krate)
            .into_iter()
            .filter(|d| d.starts_with("ratchet-"))
        {
            assert!(
                allowed.contains(&dep.as_str()),
                "{krate} must not depend on {dep}"
            );
        }
    }
}

/// The benchmarks are a program of their own: nothing of them is compiled into `ratchet`.
#[test]
fn the_benchmarks_are_not_linked_into_ratchet() {
    assert!(
        !dependencies("ratchet-cli").contains(&"ratchet-bench".to_owned()),
        "ratchet-cli depends on ratchet-bench; `ratchet bench` runs the ratchet-bench program"
    );
    let sources = rust_files(&workspace().join("crates/ratchet-cli/src"));
    for file in sources {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.starts_with("bench"),
            "{} is a benchmark in ratchet-cli; benchmarks live in ratchet-bench",
            file.display()
        );
    }
}

#[test]
fn no_statement_rewrites_a_frozen_run_config() {
    let this_file = Path::new(file!()).file_name().unwrap();
    for file in rust_files(&workspace().join("crates"))
        .into_iter()
        .filter(|f| f.file_name() != Some(this_file))
    {
        let text = std::fs::read_to_string(&file).unwrap().to_lowercase();
        for pattern in ["set config_json", "config_json =", "update run_configs"] {
            assert!(
                !text.contains(pattern),
                "{} rewrites a stored config ({pattern:?}); a run's config is frozen",
                file.display()
            );
        }
        // The one migration that moved configurations into `run_configs` points each run at
        // its own; nothing else ever points a run at another configuration.
        if file.file_name() != Some(std::ffi::OsStr::new("schema.rs")) {
            for pattern in ["set config_id", "config_id ="] {
                assert!(
                    !text.contains(pattern),
                    "{} points a run at another config ({pattern:?}); a run's config is frozen",
                    file.display()
                );
            }
        }
    }
}

#[test]
fn the_architecture_doc_maps_every_crate() {
    let doc = std::fs::read_to_string(workspace().join("docs/ARCHITECTURE.md")).unwrap();
    for krate in crates() {
        assert!(
            doc.contains(&format!("`{krate}`")),
            "docs/ARCHITECTURE.md has no codemap entry for `{krate}`"
        );
    }
}

/// A path checked and then opened by its name can be swapped for a symbolic link in between
/// (security probe F1). `workspace.rs` opens beneath a handle on the workspace instead; a tool
/// that reached for `std::fs` would bring the race back.
#[test]
fn the_tools_touch_the_filesystem_only_through_the_workspace_module() {
    let src = workspace().join("crates/ratchet-tools/src");
    let identifiers = [
        "fs",
        "File",
        "OpenOptions",
        "canonicalize",
        "rustix",
        "read_dir",
        "read_link",
        "metadata",
        "symlink_metadata",
        "hard_link",
        "create_dir",
        "remove_file",
    ];
    let methods = [".exists()", ".is_file()", ".is_dir()", ".is_symlink()"];
    for file in rust_files(&src)
        .into_iter()
        .filter(|f| *f != src.join("workspace.rs"))
    {
        let text = std::fs::read_to_string(&file).unwrap();
        // Tests set up files as they like; they come last, in one `mod tests`.
        let code = text
            .split_once("#[cfg(test)]\nmod tests {")
            .map_or(text.as_str(), |(code, _)| code);
        assert!(
            !code.contains("cfg(test)"),
            "{}: test code before the closing `mod tests` escapes this check",
            file.display()
        );
        for word in identifiers {
            assert!(
                !whole_word(word)(code),
                "{} names `{word}`; the tools crate touches the filesystem only through workspace.rs",
                file.display()
            );
        }
        for method in methods {
            assert!(
                !code.contains(method),
                "{} calls `{method}`; the tools crate touches the filesystem only through workspace.rs",
                file.display()
            );
        }
    }
}
