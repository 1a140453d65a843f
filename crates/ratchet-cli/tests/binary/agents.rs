//! `ratchet agents check DIR`: a valid catalog prints one line per agent and exits 0; a
//! catalog with problems prints every one of them with its file and line, then a summary,
//! and exits 1.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::{output_within_deadline, stderr_of, stdout_of};

fn ratchet(dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratchet"));
    command
        .args(args)
        .current_dir(dir)
        .env_remove("RATCHET_LOG");
    output_within_deadline(&mut command, "")
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

const LEAD: &str = "---
id: lead
description: Plans the work and hands it out.
model: scripted:scripts/lead.json
tools: [add, append_line]
delegates: [helper]
approval:
  append_line:
    path: \"secrets/**\"
limits:
  max_steps: 20
  max_depth: 1
---
You lead.
";

const HELPER: &str = "---
id: helper
description: >
  Adds numbers
  when asked.
model: fast
tools: [now]
---
You help.
";

#[test]
fn a_valid_catalog_prints_each_agent_with_its_hash_and_description() {
    let dir = tempfile::tempdir().unwrap();
    let agents = dir.path().join("agents");
    write(&agents.join("lead.md"), LEAD);
    write(&agents.join("helper.md"), HELPER);
    write(
        &agents.join("scripts/lead.json"),
        r#"{"replies": [{"text": "", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}, {"text": "3"}]}"#,
    );
    write(
        &dir.path().join("ratchet.toml"),
        "[models.fast]\nprovider = \"openai\"\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:9\"\n",
    );
    let output = ratchet(
        dir.path(),
        &[
            "agents",
            "check",
            agents.to_str().unwrap(),
            "--config",
            "ratchet.toml",
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let stdout = stdout_of(&output);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    for (line, (id, description)) in lines.iter().zip([
        ("helper", "Adds numbers when asked."),
        ("lead", "Plans the work and hands it out."),
    ]) {
        let hash = line.split_whitespace().nth(1).unwrap_or_default();
        assert!(
            hash.len() == 12 && hash.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')),
            "{stdout}"
        );
        // Ids are padded to the longest, so the hashes line up.
        assert_eq!(*line, format!("{id:6}  {hash}  {description}"), "{stdout}");
    }
}

#[test]
fn every_problem_is_printed_with_its_file_and_line_and_the_catalog_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let agents = dir.path().join("agents");
    write(
        &agents.join("a.md"),
        "---\nid: a\ndescription: A.\nmodel: scripted:demo\ntools: [add, rm_rf]\ndelegates: [b]\n---\nA.\n",
    );
    write(&agents.join("b.md"), "---\nid: b\ndescription: B.\n");
    write(
        &agents.join("c.md"),
        "---\nid: c\ndescription: C.\nmodel: fast\ndelegates: [c]\n---\nC.\n",
    );
    write(
        &agents.join("d.md"),
        "---\nid: d\ndescription: D.\nmodel: scripted:demo\ncolour: red\n---\nD.\n",
    );
    write(&agents.join("notes.txt"), "not a definition");
    let output = ratchet(dir.path(), &["agents", "check", agents.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert_eq!(stdout_of(&output), "");
    let stderr = stderr_of(&output);
    let file = |name: &str| agents.join(name).display().to_string();
    let expected = [
        format!(
            "{}:5: unknown tool \"rm_rf\": the runtime's tools are",
            file("a.md")
        ),
        format!("{}:6: unknown delegate \"b\"", file("a.md")),
        format!("{}:1: unterminated frontmatter", file("b.md")),
        format!(
            "{}:4: model \"fast\": invalid model spec \"fast\": no model profile",
            file("c.md")
        ),
        format!("{}:5: delegation cycle: c -> c", file("c.md")),
        format!("{}:5: unknown field `colour`", file("d.md")),
        "6 problems; the catalog was rejected".to_owned(),
    ];
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), expected.len(), "{stderr}");
    for (line, expected) in lines.iter().zip(&expected) {
        assert!(
            line.starts_with(expected.as_str()),
            "expected {expected:?}, found {line:?}"
        );
    }
}

#[test]
fn a_missing_directory_is_one_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("agents");
    let output = ratchet(dir.path(), &["agents", "check", missing.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        stderr_of(&output),
        format!(
            "{}: expected a catalog directory, found nothing at this path\n\
             1 problem; the catalog was rejected\n",
            missing.display()
        )
    );
}

#[test]
fn an_agent_named_as_the_servers_own_template_is_refused_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let agents = dir.path().join("agents");
    write(
        &agents.join("default.md"),
        "---\nid: default\ndescription: Shadowed.\nmodel: scripted:demo\n---\nD.\n",
    );
    let output = ratchet(dir.path(), &["agents", "check", agents.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert_eq!(
        stderr_of(&output),
        format!(
            "{}:2: the id \"default\" is reserved: a session naming `default` runs the server's own run template, so this agent could never be used; choose another id\n\
             1 problem; the catalog was rejected\n",
            agents.join("default.md").display()
        )
    );
}
