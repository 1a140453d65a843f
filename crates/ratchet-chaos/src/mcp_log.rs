//! What the chaos MCP server (`mcp_server.py`) records: one file per call it executed, written
//! and made durable before the call goes on (a temporary file renamed into place), so that a
//! kill loses none and leaves no record cut short.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionKind {
    /// The call did its work.
    Exec,
    /// A `keyed` call whose key had done its work already: answered without doing it again.
    Replay,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Execution {
    pub kind: ExecutionKind,
    /// The tool's name on the server (`hang`, `drop`, `flaky`).
    pub tool: String,
    /// The idempotency key the runtime sent in `_meta`.
    pub key: String,
    /// The model's call id, which the plan passes as the `line` argument.
    pub line: String,
}

/// The executions recorded so far in the order of the calls, and the records that are not one
/// (which no server wrote), each as its file's name and text.
pub fn read(directory: &Path) -> std::io::Result<(Vec<Execution>, Vec<String>)> {
    let entries = match std::fs::read_dir(directory) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Ok((Vec::new(), Vec::new()));
        }
        Err(error) => return Err(error),
    };
    let mut names = Vec::new();
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        // A temporary file is a record a kill stopped before it was renamed into place.
        if !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort();
    let mut executions = Vec::new();
    let mut strays = Vec::new();
    for name in names {
        let text = std::fs::read_to_string(directory.join(&name))?;
        match serde_json::from_str(&text) {
            Ok(execution) if name.ends_with(".json") => executions.push(execution),
            _ => strays.push(format!("{name}: {text}")),
        }
    }
    Ok((executions, strays))
}

/// Whether the server executed the call with this idempotency key.
pub fn executed(directory: &Path, key: &str) -> std::io::Result<bool> {
    let suffix = format!("-{}.json", quoted(key));
    let entries = match std::fs::read_dir(directory) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(error),
    };
    for entry in entries {
        let entry = entry?;
        if !entry.file_name().to_string_lossy().ends_with(&suffix) {
            continue;
        }
        let text = std::fs::read_to_string(entry.path())?;
        if serde_json::from_str::<Execution>(&text)
            .is_ok_and(|e| e.key == key && e.kind == ExecutionKind::Exec)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The key as the server puts it in a record's file name: Python's `urllib.parse.quote(key,
/// safe="")`, every byte but ASCII letters, digits and `_.-~` percent-encoded.
fn quoted(key: &str) -> String {
    key.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_quoted_as_the_server_quotes_them() {
        assert_eq!(quoted("run_01ab#2#3"), "run_01ab%232%233");
        assert_eq!(quoted("a/b c~d"), "a%2Fb%20c~d");
        assert_eq!(quoted(""), "");
    }

    #[test]
    fn records_are_read_in_call_order_and_a_killed_write_leaves_none() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        let record = |kind: &str, key: &str| {
            format!(
                r#"{{"kind": "{kind}", "tool": "flaky", "key": "{key}", "line": "c-1", "pid": 7}}"#
            )
        };
        write(
            "00000000000000000002-7-k%231.json",
            &record("replay", "k#1"),
        );
        write("00000000000000000001-7-k%231.json", &record("exec", "k#1"));
        write(".00000000000000000003-7-k%232.tmp", r#"{"kind": "ex"#);
        let (executions, strays) = read(dir.path()).unwrap();
        let kinds: Vec<_> = executions.iter().map(|e| e.kind.clone()).collect();
        assert_eq!(kinds, [ExecutionKind::Exec, ExecutionKind::Replay]);
        assert!(strays.is_empty(), "{strays:?}");
        assert!(executed(dir.path(), "k#1").unwrap());
        assert!(!executed(dir.path(), "k#2").unwrap());

        write("00000000000000000004-7-x.json", "not a record");
        assert_eq!(
            read(dir.path()).unwrap().1.len(),
            1,
            "a file no server wrote"
        );
    }
}
