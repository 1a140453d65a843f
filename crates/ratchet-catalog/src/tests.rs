//! Tests of loading catalogs: one per rejection rule (file, line, what the message says), a
//! valid catalog read field by field, every problem of a catalog reported at once, and any
//! bytes at all as a definition.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use ratchet_core::inbox::{Severity, SignalContract};
use ratchet_core::{ApprovalPolicy, Delivery};
use tempfile::TempDir;

use crate::{AgentLimits, Catalog, Known, MAX_FILE_BYTES, Problem};

/// A runtime offering three tools, scripted models (whose files must arrive resolved) and
/// `openai:` models.
struct Runtime;

impl Known for Runtime {
    fn tool(&self, name: &str) -> Result<(), String> {
        if ["add", "now", "append_line"].contains(&name) {
            Ok(())
        } else {
            Err("the runtime's tools are add, now, append_line".into())
        }
    }

    fn model(&self, spec: &str) -> Result<(), String> {
        match spec.split_once(':') {
            Some(("scripted", "demo")) | Some(("openai", _)) => Ok(()),
            Some(("scripted", file)) if Path::new(file).is_absolute() => Ok(()),
            _ => Err("expected scripted:FILE, scripted:demo or openai:MODEL".into()),
        }
    }
}

/// A definition: `---` on line 1, id on 2, description on 3, model on 4, then `extra`
/// (from line 5), the closing `---` and a one-line prompt.
fn definition(id: &str, model: &str, extra: &str) -> String {
    format!(
        "---\nid: {id}\ndescription: Does {id} things.\nmodel: {model}\n{extra}---\nYou are {id}.\n"
    )
}

fn agent(id: &str, extra: &str) -> String {
    definition(id, "scripted:demo", extra)
}

fn catalog(files: &[(&str, &str)]) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn problems(dir: &Path) -> Vec<Problem> {
    match Catalog::load(dir, &Runtime) {
        Ok(catalog) => panic!("expected problems, the catalog loaded: {catalog:?}"),
        Err(problems) => problems,
    }
}

/// The one problem of a catalog, which must be in `file` at `line` and say `says`.
fn only_problem(dir: &Path, file: &str, line: Option<usize>, says: &str) -> Problem {
    let problems = problems(dir);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    let problem = problems.into_iter().next().unwrap();
    assert_eq!(problem.file, absolute(dir).join(file), "{problem}");
    assert_eq!(problem.line, line, "{problem}");
    assert!(problem.message.contains(says), "{problem}");
    problem
}

fn absolute(dir: &Path) -> PathBuf {
    std::path::absolute(dir).unwrap()
}

#[test]
fn an_unknown_frontmatter_key_is_a_problem_at_its_line() {
    let dir = catalog(&[("a.md", &agent("a", "colour: blue\n"))]);
    only_problem(dir.path(), "a.md", Some(5), "colour");
}

#[test]
fn a_key_given_twice_is_a_problem_at_its_second_line() {
    let dir = catalog(&[("a.md", &agent("a", "id: b\n"))]);
    only_problem(dir.path(), "a.md", Some(5), "id");
}

#[test]
fn broken_yaml_is_a_problem_at_the_parsers_line_counted_from_the_files_start() {
    let dir = catalog(&[("a.md", &agent("a", "tools: [add\nlimits: {}\n"))]);
    // The parser stumbles on line 5 of the frontmatter, the file's line 6.
    only_problem(dir.path(), "a.md", Some(6), "':'");
}

#[test]
fn an_unquoted_colon_in_a_value_is_a_problem_that_says_to_quote_it() {
    let text = "---\nid: a\ndescription: Plans a trip: books the rooms\nmodel: scripted:demo\n---\nYou plan.\n";
    let dir = catalog(&[("a.md", text)]);
    let problem = only_problem(dir.path(), "a.md", Some(3), "must be quoted");
    assert!(
        problem
            .to_string()
            .contains("mapping values are not allowed"),
        "{problem}"
    );
}

#[test]
fn a_bad_id_is_a_problem_at_the_id_line() {
    for id in ["Writer", "9lives", "a.b", "\"\"", &"a".repeat(65)] {
        let dir = catalog(&[("a.md", &agent(id, ""))]);
        only_problem(dir.path(), "a.md", Some(2), "[a-z][a-z0-9_-]{0,63}");
    }
    let longest = "a".repeat(64);
    let dir = catalog(&[("a.md", &agent(&longest, ""))]);
    assert!(Catalog::load(dir.path(), &Runtime).is_ok());
}

#[test]
fn an_id_the_server_uses_itself_is_a_problem_at_the_id_line() {
    let dir = catalog(&[("d.md", &agent("default", "")), ("a.md", &agent("a", ""))]);
    let problem = only_problem(
        dir.path(),
        "d.md",
        Some(2),
        "the id \"default\" is reserved: a session naming `default` runs the server's own run template",
    );
    assert!(
        problem
            .to_string()
            .ends_with(&format!("d.md:2: {}", problem.message)),
        "{problem}"
    );
    let dir = catalog(&[("a.md", &agent("defaults", ""))]);
    assert!(
        Catalog::load(dir.path(), &Runtime).is_ok(),
        "only the exact name is reserved"
    );
}

#[test]
fn a_duplicate_id_names_both_files() {
    let dir = catalog(&[
        ("a.md", &agent("writer", "")),
        ("b.md", &agent("writer", "")),
    ]);
    let problem = only_problem(dir.path(), "b.md", Some(2), "unique agent id");
    let first = absolute(dir.path()).join("a.md");
    assert!(
        problem.message.contains(&first.display().to_string()),
        "{problem}"
    );
}

#[test]
fn ids_are_compared_ignoring_case() {
    let dir = catalog(&[
        ("a.md", &agent("writer", "")),
        ("b.md", &agent("Writer", "")),
    ]);
    let problems = problems(dir.path());
    let duplicate = problems
        .iter()
        .find(|p| p.message.contains("unique agent id"))
        .unwrap_or_else(|| panic!("no duplicate reported: {problems:#?}"));
    assert_eq!(duplicate.file, absolute(dir.path()).join("b.md"));
    assert!(duplicate.message.contains("\"Writer\""), "{duplicate}");
    assert!(duplicate.message.contains("\"writer\""), "{duplicate}");
}

#[test]
fn an_unknown_tool_is_a_problem_at_its_line_with_the_checkers_reason() {
    let dir = catalog(&[("a.md", &agent("a", "tools:\n  - add\n  - rm_rf\n"))]);
    let problem = only_problem(dir.path(), "a.md", Some(7), "\"rm_rf\"");
    assert!(
        problem.message.contains("add, now, append_line"),
        "{problem}"
    );
}

#[test]
fn tools_the_runtime_injects_must_not_be_listed() {
    for (tool, says) in [
        ("delegate", "list agents under `delegates` instead"),
        ("agent_task", "list agents under `delegates` instead"),
        ("emit_signal", "`signal` contract"),
    ] {
        let dir = catalog(&[("a.md", &agent("a", &format!("tools: [now, {tool}]\n")))]);
        let problem = only_problem(dir.path(), "a.md", Some(5), says);
        assert!(
            problem
                .message
                .contains(&format!("`{tool}` is injected by the runtime")),
            "{problem}"
        );
    }
}

#[test]
fn a_tool_or_delegate_listed_twice_is_a_problem_at_its_second_line() {
    let dir = catalog(&[
        ("a.md", &agent("a", "tools: [add, now, add]\n")),
        ("b.md", &agent("b", "delegates:\n  - a\n  - a\n")),
    ]);
    let root = absolute(dir.path());
    let found: Vec<(PathBuf, Option<usize>, String)> = problems(dir.path())
        .into_iter()
        .map(|p| (p.file, p.line, p.message))
        .collect();
    assert_eq!(
        found,
        [
            (
                root.join("a.md"),
                Some(5),
                "tool \"add\" is listed twice".to_owned()
            ),
            (
                root.join("b.md"),
                Some(7),
                "delegate \"a\" is listed twice".to_owned()
            ),
        ]
    );
}

#[test]
fn an_unknown_delegate_is_a_problem_at_its_line() {
    let dir = catalog(&[
        ("a.md", &agent("a", "delegates:\n  - b\n  - ghost\n")),
        ("b.md", &agent("b", "")),
    ]);
    let problem = only_problem(dir.path(), "a.md", Some(7), "unknown delegate \"ghost\"");
    assert!(problem.message.contains("(a, b)"), "{problem}");
}

#[test]
fn a_model_the_checker_refuses_is_a_problem_at_the_model_line() {
    let dir = catalog(&[("a.md", &definition("a", "gpt:large", ""))]);
    let problem = only_problem(dir.path(), "a.md", Some(4), "\"gpt:large\"");
    assert!(
        problem.message.contains("expected scripted:FILE"),
        "{problem}"
    );
}

#[test]
fn a_missing_scripted_model_file_is_a_problem_at_the_model_line() {
    let dir = catalog(&[("a.md", &definition("a", "scripted:missing.json", ""))]);
    only_problem(dir.path(), "a.md", Some(4), "\"missing.json\"");
}

#[test]
fn an_empty_body_is_a_problem_where_the_body_starts() {
    let text = "---\nid: a\ndescription: d\nmodel: scripted:demo\n---\n\n   \n\t\n";
    let dir = catalog(&[("a.md", text)]);
    only_problem(dir.path(), "a.md", Some(6), "empty body");
}

#[test]
fn a_file_that_is_not_utf8_is_a_problem_at_the_line_of_the_bad_byte() {
    let mut bytes = agent("a", "").into_bytes();
    let description = bytes.iter().position(|b| *b == b'D').unwrap();
    bytes[description] = 0xff;
    let dir = catalog(&[]);
    std::fs::write(dir.path().join("a.md"), bytes).unwrap();
    only_problem(dir.path(), "a.md", Some(3), "not UTF-8");
}

#[test]
fn a_file_over_256_kib_is_refused_before_it_is_parsed() {
    let mut text = agent("a", "");
    text.push_str(&"x".repeat(MAX_FILE_BYTES as usize + 1 - text.len()));
    let dir = catalog(&[("a.md", &text)]);
    only_problem(dir.path(), "a.md", None, "at most 262144 bytes");
    text.pop();
    std::fs::write(dir.path().join("a.md"), &text).unwrap();
    let catalog = Catalog::load(dir.path(), &Runtime).unwrap();
    let prompt = &text[text.find("You are a.").unwrap()..];
    assert_eq!(catalog.get("a").unwrap().system_prompt, prompt);
}

#[test]
fn a_symlink_out_of_the_catalog_is_a_problem_and_one_inside_is_a_definition() {
    let outside = catalog(&[("elsewhere.md", &agent("elsewhere", ""))]);
    let dir = catalog(&[]);
    std::fs::create_dir(dir.path().join("shared")).unwrap();
    std::fs::write(dir.path().join("shared/inner.txt"), agent("inner", "")).unwrap();
    std::os::unix::fs::symlink(
        dir.path().join("shared/inner.txt"),
        dir.path().join("inner.md"),
    )
    .unwrap();
    assert_eq!(
        Catalog::load(dir.path(), &Runtime)
            .unwrap()
            .get("inner")
            .unwrap()
            .system_prompt,
        "You are inner."
    );
    std::os::unix::fs::symlink(
        outside.path().join("elsewhere.md"),
        dir.path().join("elsewhere.md"),
    )
    .unwrap();
    only_problem(
        dir.path(),
        "elsewhere.md",
        None,
        "expected a symlink to a file inside the catalog directory",
    );
}

#[test]
fn a_file_without_frontmatter_is_a_problem_at_line_one() {
    let dir = catalog(&[("a.md", "# Writer\n\nYou write.\n")]);
    only_problem(dir.path(), "a.md", Some(1), "first line must be `---`");
}

#[test]
fn unterminated_frontmatter_is_a_problem_at_line_one() {
    let dir = catalog(&[("a.md", "---\nid: a\ndescription: d\nmodel: scripted:demo\n")]);
    only_problem(dir.path(), "a.md", Some(1), "unterminated frontmatter");
}

#[test]
fn every_delegation_cycle_is_named_once() {
    let dir = catalog(&[
        ("a.md", &agent("a", "delegates: [b]\n")),
        ("b.md", &agent("b", "delegates: [c, a]\n")),
        ("c.md", &agent("c", "")),
        ("s.md", &agent("s", "delegates:\n  - c\n  - s\n")),
    ]);
    let problems = problems(dir.path());
    let found: Vec<(PathBuf, Option<usize>, &str)> = problems
        .iter()
        .map(|p| (p.file.clone(), p.line, p.message.as_str()))
        .collect();
    let root = absolute(dir.path());
    assert_eq!(
        found,
        [
            (root.join("a.md"), Some(5), "delegation cycle: a -> b -> a"),
            (root.join("s.md"), Some(7), "delegation cycle: s -> s"),
        ]
    );
}

#[test]
fn a_directory_that_is_missing_a_file_or_empty_is_a_problem() {
    let dir = catalog(&[("notes.txt", "not an agent"), ("readme.MD.bak", "")]);
    std::fs::create_dir(dir.path().join("nested.md")).unwrap();
    std::fs::write(dir.path().join("nested.md/a.md"), agent("a", "")).unwrap();
    let root = absolute(dir.path());
    let problem = problems(dir.path()).remove(0);
    assert_eq!(
        (problem.file.as_path(), problem.line),
        (root.as_path(), None)
    );
    assert!(problem.message.contains("empty catalog"), "{problem}");

    let missing = root.join("absent");
    let problem = problems(&missing).remove(0);
    assert_eq!(problem.file, missing);
    assert!(problem.message.contains("found nothing"), "{problem}");

    let file = root.join("notes.txt");
    let problem = problems(&file).remove(0);
    assert_eq!(problem.file, file);
    assert!(problem.message.contains("found a file"), "{problem}");
}

#[test]
fn limits_and_signal_values_out_of_range_are_problems_at_their_line() {
    for (extra, line, says) in [
        ("limits:\n  max_steps: 5\n  max_depth: 0\n", 7, "at least 1"),
        ("limits:\n  max_parallel: -1\n", 6, "at least 1, found -1"),
        ("limits:\n  max_parallel: 5000000000\n", 6, "fits a u32"),
        ("limits:\n  max_tokens: \"5\"\n", 6, "string \"5\""),
        ("limits:\n  max_turns: 3\n", 6, "max_turns"),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 65537\n  severities: [info]\n  dedupe_window_ms: 0\n",
            8,
            "at most 65536",
        ),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 10\n  severities: []\n  dedupe_window_ms: 0\n",
            9,
            "at least one severity",
        ),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 10\n  severities: [info, info]\n  dedupe_window_ms: 0\n",
            9,
            "listed twice",
        ),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 10\n  severities: [debug]\n  dedupe_window_ms: 0\n",
            9,
            "debug",
        ),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 10\n  severities: [info]\n  dedupe_window_ms: 0\n  delivery: shout\n",
            11,
            "shout",
        ),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 10\n  severities: [info]\n  dedupe_window_ms: 0\n  max_burst: 0\n",
            11,
            "at least 1, found 0",
        ),
        (
            "signal:\n  max_count: 1\n  min_interval_ms: 0\n  max_bytes: 10\n  severities: [info]\n  dedupe_window_ms: 0\n  max_depth: 65\n",
            11,
            "a depth of at most 64, found 65",
        ),
        ("limits:\n  max_tool_result_bytes: 0\n", 6, "at least 1"),
    ] {
        let dir = catalog(&[("a.md", &agent("a", extra))]);
        only_problem(dir.path(), "a.md", Some(line), says);
    }
}

#[test]
fn an_approval_policy_must_be_for_a_listed_tool_and_valid() {
    for (extra, line, says) in [
        (
            "tools: [add]\napproval:\n  now: always\n",
            7,
            "approval policy for tool \"now\", which this agent does not list; its tools are add",
        ),
        (
            "tools: [append_line]\napproval:\n  append_line:\n    path: \"[\"\n",
            8,
            "invalid glob",
        ),
        (
            "tools: [add]\napproval:\n  add: sometimes\n",
            7,
            "sometimes",
        ),
        // YAML 1.2 booleans only: `yes` is the word, not `true`.
        ("tools: [add]\napproval:\n  add: yes\n", 7, "string \"yes\""),
        (
            "tools: [add]\napproval:\n  add: {}\n",
            7,
            "at least one argument glob",
        ),
    ] {
        let dir = catalog(&[("a.md", &agent("a", extra))]);
        only_problem(dir.path(), "a.md", Some(line), says);
    }
}

#[test]
fn a_description_must_say_something_briefly() {
    let dir = catalog(&[("a.md", &agent("a", "").replace("Does a things.", "\"  \""))]);
    only_problem(dir.path(), "a.md", Some(3), "empty one");
    let long = "d".repeat(1025);
    let dir = catalog(&[("a.md", &agent("a", "").replace("Does a things.", &long))]);
    only_problem(
        dir.path(),
        "a.md",
        Some(3),
        "at most 1024 characters, found 1025",
    );
}

const LEAD: &str = "---
id: lead
description: Plans the work and hands it out.
model: scripted:scripts/lead.json
tools: [add, append_line]
delegates: [researcher, writer]
limits:
  max_steps: 20
  max_parallel: 4
  max_depth: 2
  max_tree_runs: 10
approval:
  append_line:
    path: \"secrets/**\"
  add: never
---

You lead. Delegate research, then writing.
";

const RESEARCHER: &str = "---
id: researcher
description: Finds facts.
model: openai:gpt-4o-mini
tools: [now]
delegates: [writer]
signal:
  max_count: 3
  min_interval_ms: 1000
  max_bytes: 2048
  severities: [warning, critical]
  dedupe_window_ms: 60000
  delivery: steer
---
You research.
";

const WRITER: &str = "---
id: writer
description: |
  Writes prose.
model: scripted:demo
---
You write.
";

/// SHA-256 of `WRITER`, computed apart from the crate.
const WRITER_SHA256: &str = "4f150189a9d9dca22b92bdf8bc9b69575b99fe244011e0429577d5d6fe3c2891";

#[test]
fn a_valid_catalog_loads_every_field() {
    let dir = catalog(&[
        ("lead.md", LEAD),
        ("researcher.md", RESEARCHER),
        ("writer.md", WRITER),
        ("notes.txt", "ignored"),
    ]);
    std::fs::create_dir(dir.path().join("scripts")).unwrap();
    std::fs::write(dir.path().join("scripts/lead.json"), "{\"replies\": []}").unwrap();
    let catalog = Catalog::load(dir.path(), &Runtime).unwrap();
    let root = absolute(dir.path());
    assert_eq!(catalog.dir(), root);
    let ids: Vec<&str> = catalog.agents().map(|a| a.id.as_str()).collect();
    assert_eq!(ids, ["lead", "researcher", "writer"]);

    let lead = catalog.get("lead").unwrap();
    let script = root.join("scripts/lead.json").canonicalize().unwrap();
    assert_eq!(lead.model, format!("scripted:{}", script.display()));
    assert_eq!(lead.description, "Plans the work and hands it out.");
    assert_eq!(lead.tools, ["add", "append_line"]);
    assert_eq!(lead.delegates, ["researcher", "writer"]);
    assert_eq!(
        lead.limits,
        AgentLimits {
            max_steps: Some(20),
            max_parallel: Some(4),
            max_depth: Some(2),
            max_tree_runs: Some(10),
            ..AgentLimits::default()
        }
    );
    assert_eq!(
        lead.approval,
        [
            ("add".to_owned(), ApprovalPolicy::Never),
            (
                "append_line".to_owned(),
                ApprovalPolicy::WhenArguments([("path".into(), "secrets/**".into())].into())
            ),
        ]
        .into()
    );
    assert_eq!(lead.signal, None);
    assert_eq!(
        lead.system_prompt,
        "You lead. Delegate research, then writing."
    );
    assert_eq!(lead.path, root.join("lead.md"));

    let researcher = catalog.get("researcher").unwrap();
    assert_eq!(researcher.model, "openai:gpt-4o-mini");
    assert_eq!(researcher.limits, AgentLimits::default());
    assert_eq!(
        researcher.signal,
        Some(SignalContract {
            max_count: 3,
            min_interval_ms: 1000,
            max_bytes: 2048,
            severities: vec![Severity::Warning, Severity::Critical],
            dedupe_window_ms: 60000,
            delivery: Delivery::Steer,
            max_burst: 1,
            max_depth: 8,
        })
    );

    let writer = catalog.get("writer").unwrap();
    assert_eq!(writer.description, "Writes prose.");
    assert_eq!(writer.model, "scripted:demo");
    assert!(writer.tools.is_empty() && writer.delegates.is_empty());
    assert_eq!(writer.system_prompt, "You write.");
    assert_eq!(writer.hash, WRITER_SHA256);
    assert!(catalog.get("Writer").is_none());

    std::fs::write(
        dir.path().join("writer.md"),
        WRITER.replace("prose", "Prose"),
    )
    .unwrap();
    let changed = Catalog::load(dir.path(), &Runtime).unwrap();
    assert_ne!(changed.get("writer").unwrap().hash, writer.hash);
    assert_eq!(changed.get("lead").unwrap().hash, lead.hash);
}

#[test]
fn a_signal_contract_reads_its_burst_and_depth_and_limits_their_tool_results() {
    let text = RESEARCHER.replace(
        "  delivery: steer\n",
        "  delivery: steer\n  max_burst: 4\n  max_depth: 2\nlimits:\n  max_tool_result_bytes: 1000\n",
    );
    let dir = catalog(&[("researcher.md", &text), ("writer.md", WRITER)]);
    let catalog = Catalog::load(dir.path(), &Runtime).unwrap();
    let researcher = catalog.get("researcher").unwrap();
    let signal = researcher.signal.clone().unwrap();
    assert_eq!((signal.max_burst, signal.max_depth), (4, 2));
    assert_eq!(researcher.limits.max_tool_result_bytes, Some(1000));
}

#[test]
fn a_signal_contract_delivers_to_the_queue_unless_it_says_otherwise() {
    let text = RESEARCHER.replace("  delivery: steer\n", "");
    let dir = catalog(&[("researcher.md", &text), ("writer.md", WRITER)]);
    let catalog = Catalog::load(dir.path(), &Runtime).unwrap();
    let signal = catalog.get("researcher").unwrap().signal.clone().unwrap();
    assert_eq!(signal.delivery, Delivery::Queue);
}

#[test]
fn every_problem_of_every_file_is_reported_at_once() {
    let dir = catalog(&[
        ("a.md", &agent("A", "tools: [rm_rf]\n")),
        ("b.md", "---\nid: b\n"),
        ("c.md", &agent("c", "delegates: [ghost]\n")),
        ("d.md", &definition("d", "scripted:nope.json", "")),
        ("e.md", ""),
    ]);
    let root = absolute(dir.path());
    let found: Vec<(PathBuf, Option<usize>)> = problems(dir.path())
        .into_iter()
        .map(|p| (p.file, p.line))
        .collect();
    assert_eq!(
        found,
        [
            (root.join("a.md"), Some(2)),
            (root.join("a.md"), Some(5)),
            (root.join("b.md"), Some(1)),
            (root.join("c.md"), Some(5)),
            (root.join("d.md"), Some(4)),
            (root.join("e.md"), Some(1)),
        ]
    );
}

#[test]
fn a_problem_shows_as_file_line_message() {
    let mut problem = Problem {
        file: PathBuf::from("agents/a.md"),
        line: Some(3),
        message: "bad".into(),
    };
    assert_eq!(problem.to_string(), "agents/a.md:3: bad");
    problem.line = None;
    assert_eq!(problem.to_string(), "agents/a.md: bad");
}

/// Lines a definition might have, right or wrong, to fuzz close to the format.
fn line() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("---\n".to_owned()),
        Just("id: a\n".to_owned()),
        Just("description: d\n".to_owned()),
        Just("model: scripted:demo\n".to_owned()),
        Just("model: scripted:x.json\n".to_owned()),
        Just("tools: [add, delegate]\n".to_owned()),
        Just("delegates: [a, b]\n".to_owned()),
        Just("limits: {max_steps: 0}\n".to_owned()),
        Just("approval: {add: always}\n".to_owned()),
        Just("signal: {max_count: 1}\n".to_owned()),
        Just("&x a: *x\n".to_owned()),
        any::<String>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever a definition file holds, loading it gives a catalog of that one agent or
    /// problems about that file, and never panics.
    #[test]
    fn any_bytes_as_a_definition_load_or_give_problems(
        bytes in prop_oneof![
            any::<Vec<u8>>(),
            prop::collection::vec(line(), 0..12).prop_map(|lines| lines.concat().into_bytes()),
        ],
    ) {
        let dir = catalog(&[]);
        std::fs::write(dir.path().join("a.md"), &bytes).unwrap();
        match Catalog::load(dir.path(), &Runtime) {
            Ok(catalog) => prop_assert_eq!(catalog.agents().count(), 1),
            Err(problems) => {
                prop_assert!(!problems.is_empty());
                let file = absolute(dir.path()).join("a.md");
                for problem in problems {
                    prop_assert_eq!(&problem.file, &file);
                    prop_assert!(!problem.message.trim().is_empty());
                }
            }
        }
    }
}

#[test]
fn a_completion_block_is_read_and_its_tools_must_be_listed() {
    let extra = "tools: [add]\ncompletion:\n  require_tools: [add]\n  require_fields: [summary, score.value]\n  min_steps: 3\n";
    let dir = catalog(&[("a.md", &agent("a", extra))]);
    let loaded = Catalog::load(dir.path(), &Runtime).unwrap();
    assert_eq!(
        loaded.get("a").unwrap().completion,
        Some(ratchet_core::CompletionCriteria {
            required_tools: vec!["add".into()],
            required_fields: vec!["summary".into(), "score.value".into()],
            min_steps: 3,
            max_attempts: ratchet_core::CompletionCriteria::DEFAULT_MAX_ATTEMPTS,
        })
    );
    for (extra, line, says) in [
        (
            "tools: [add]\ncompletion:\n  require_tools: [now]\n",
            7,
            "completion requires tool \"now\", which this agent does not list",
        ),
        ("completion:\n  require_fields: [a..b]\n", 6, "empty name"),
        ("completion:\n  max_attempts: 0\n", 6, "at least 1, found 0"),
        (
            "completion:\n  require_everything: true\n",
            6,
            "require_everything",
        ),
    ] {
        let dir = catalog(&[("a.md", &agent("a", extra))]);
        only_problem(dir.path(), "a.md", Some(line), says);
    }
}
