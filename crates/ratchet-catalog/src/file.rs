//! One definition file: its YAML frontmatter split from its body and parsed strictly, then
//! every check that needs only the file itself and the runtime's tools and models. Checks
//! that need the other files (ids, delegates) are the catalog's.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use ratchet_core::ApprovalPolicy;
use ratchet_core::delegation::RESERVED_AGENT_IDS;
use serde::Deserialize;
use serde::de::{self, MapAccess, Unexpected, Visitor};
use serde_saphyr::{Location, MessageFormatter, Spanned, UserMessageFormatter};
use sha2::{Digest, Sha256};

use crate::definition::{CompletionSpec, SignalSpec};
use crate::{AgentDefinition, AgentLimits, Known, Problem};

/// Longest description a delegating model is shown.
const MAX_DESCRIPTION_CHARS: usize = 1024;

/// Tools the runtime gives an agent itself, with what to write instead of listing them.
const INJECTED_TOOLS: [(&str, &str); 3] = [
    ("delegate", "list agents under `delegates` instead"),
    ("agent_task", "list agents under `delegates` instead"),
    ("emit_signal", "declare a `signal` contract instead"),
];

/// A file whose frontmatter could be read, checked or not: the catalog still looks at its
/// id and delegates, so that one pass reports every problem.
pub(crate) struct Parsed {
    pub definition: AgentDefinition,
    pub id_line: Option<usize>,
    /// The line of each of `definition.delegates`, in order.
    pub delegate_lines: Vec<Option<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Frontmatter {
    id: Spanned<String>,
    description: Spanned<String>,
    model: Spanned<String>,
    #[serde(default)]
    tools: Vec<Spanned<String>>,
    #[serde(default)]
    delegates: Vec<Spanned<String>>,
    #[serde(default)]
    limits: AgentLimits,
    #[serde(default)]
    approval: BTreeMap<String, Spanned<Policy>>,
    signal: Option<SignalSpec>,
    completion: Option<Spanned<CompletionSpec>>,
}

/// An approval policy as a definition writes it: `always`, `never`, or a map of argument
/// names to globs.
struct Policy(ApprovalPolicy);

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Policy, D::Error> {
        deserializer.deserialize_any(PolicyVisitor)
    }
}

struct PolicyVisitor;

impl<'de> Visitor<'de> for PolicyVisitor {
    type Value = Policy;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("`always`, `never` or a map of argument names to globs")
    }

    fn visit_str<E: de::Error>(self, mode: &str) -> Result<Policy, E> {
        match mode {
            "always" => Ok(Policy(ApprovalPolicy::Always)),
            "never" => Ok(Policy(ApprovalPolicy::Never)),
            other => Err(E::invalid_value(Unexpected::Str(other), &self)),
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Policy, A::Error> {
        let mut rules = BTreeMap::new();
        while let Some((argument, glob)) = map.next_entry::<String, String>()? {
            rules.insert(argument, glob);
        }
        if rules.is_empty() {
            return Err(de::Error::custom(
                "expected at least one argument glob, found an empty map",
            ));
        }
        Ok(Policy(ApprovalPolicy::WhenArguments(rules)))
    }
}

/// The parts of a file around its closing `---`.
struct Split<'a> {
    frontmatter: &'a str,
    body: &'a str,
    /// The file's line the body starts on.
    body_line: usize,
}

fn is_fence(line: &str) -> bool {
    line.trim_end_matches(['\n', '\r']) == "---"
}

fn split(text: &str) -> Result<Split<'_>, String> {
    let mut lines = text.split_inclusive('\n');
    let first = lines.next().unwrap_or_default();
    if !is_fence(first) {
        let found: String = first.trim_end().chars().take(60).collect();
        return Err(format!(
            "expected YAML frontmatter: the first line must be `---`, found {found:?}"
        ));
    }
    let start = first.len();
    let mut end = start;
    for (index, line) in lines.enumerate() {
        if is_fence(line) {
            return Ok(Split {
                frontmatter: &text[start..end],
                body: &text[end + line.len()..],
                // The opening fence is line 1, this closing one is line index + 2.
                body_line: index + 3,
            });
        }
        end += line.len();
    }
    Err("unterminated frontmatter: expected a closing `---` line after the opening one".into())
}

/// A frontmatter location as a line of the file, past the opening fence; `None` when the
/// parser does not know it.
fn file_line(location: Location) -> Option<usize> {
    match location.line() {
        0 => None,
        line => usize::try_from(line).ok().map(|line| line + 1),
    }
}

fn yaml_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    // YAML 1.1 reads `yes`, `no`, `on` and `off` as booleans; a definition means the words.
    options.strict_booleans = true;
    // The problem carries the file and line; a rendered snippet would repeat them.
    options.with_snippet = false;
    options
}

fn yaml_message(error: &serde_saphyr::Error) -> String {
    let message: String = UserMessageFormatter
        .format_message(error)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    // The usual cause, in a definition written as Markdown: prose with a colon in it.
    if message.contains("mapping values are not allowed") {
        return format!(
            "{message}; a value holding a colon followed by a space must be quoted, as in description: \"Plans a trip: books the rooms\""
        );
    }
    message
}

/// Whether an id matches `[a-z][a-z0-9_-]{0,63}`.
fn is_valid_id(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && id.len() <= 64
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// Reads one definition; `dir` is the catalog's directory, which a scripted model's file is
/// relative to.
pub(crate) fn parse(
    path: &Path,
    dir: &Path,
    bytes: &[u8],
    known: &dyn Known,
) -> (Option<Parsed>, Vec<Problem>) {
    let problem = |line: Option<usize>, message: String| Problem {
        file: path.to_path_buf(),
        line,
        message,
    };
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => {
            let valid = &bytes[..error.valid_up_to()];
            let line = valid.iter().filter(|b| **b == b'\n').count() + 1;
            let message = format!(
                "expected UTF-8 text, found a byte sequence that is not UTF-8 at byte {}",
                error.valid_up_to()
            );
            return (None, vec![problem(Some(line), message)]);
        }
    };
    let split = match split(text) {
        Ok(split) => split,
        Err(message) => return (None, vec![problem(Some(1), message)]),
    };
    let frontmatter: Frontmatter =
        match serde_saphyr::from_str_with_options(split.frontmatter, yaml_options()) {
            Ok(frontmatter) => frontmatter,
            Err(error) => {
                let line = error.location().and_then(file_line);
                return (None, vec![problem(line, yaml_message(&error))]);
            }
        };
    let mut problems = Vec::new();
    let mut report = |line: Option<usize>, message: String| problems.push(problem(line, message));

    let id_line = file_line(frontmatter.id.referenced);
    let id = frontmatter.id.value;
    if !is_valid_id(&id) {
        report(
            id_line,
            format!(
                "expected an id of a lowercase letter then at most 63 lowercase letters, \
                 digits, `_` or `-` ([a-z][a-z0-9_-]{{0,63}}), found {id:?}"
            ),
        );
    }
    if let Some((_, meaning)) = RESERVED_AGENT_IDS.iter().find(|(name, _)| *name == id) {
        report(
            id_line,
            format!(
                "the id {id:?} is reserved: {meaning}, so this agent could never be used; choose another id"
            ),
        );
    }

    let description = frontmatter.description.value.trim().to_owned();
    let description_line = file_line(frontmatter.description.referenced);
    let length = description.chars().count();
    if description.is_empty() {
        report(
            description_line,
            "expected a description telling a delegating model what this agent does, found \
             an empty one"
                .into(),
        );
    } else if length > MAX_DESCRIPTION_CHARS {
        report(
            description_line,
            format!(
                "expected a description of at most {MAX_DESCRIPTION_CHARS} characters, found \
                 {length}"
            ),
        );
    }

    let model_line = file_line(frontmatter.model.referenced);
    let written = frontmatter.model.value;
    let model = match resolve_model(&written, dir) {
        Ok(model) => {
            if let Err(why) = known.model(&model) {
                report(model_line, format!("model {written:?}: {why}"));
            }
            model
        }
        Err(why) => {
            report(model_line, why);
            written
        }
    };

    let mut tools: Vec<String> = Vec::new();
    for tool in frontmatter.tools {
        let line = file_line(tool.referenced);
        let name = tool.value;
        if let Some((_, instead)) = INJECTED_TOOLS.iter().find(|(n, _)| *n == name) {
            report(
                line,
                format!("`{name}` is injected by the runtime; {instead}"),
            );
        } else if tools.contains(&name) {
            report(line, format!("tool {name:?} is listed twice"));
        } else if let Err(why) = known.tool(&name) {
            report(line, format!("unknown tool {name:?}: {why}"));
        }
        tools.push(name);
    }

    let mut delegates: Vec<String> = Vec::new();
    let mut delegate_lines = Vec::new();
    for delegate in frontmatter.delegates {
        let line = file_line(delegate.referenced);
        if delegates.contains(&delegate.value) {
            report(
                line,
                format!("delegate {:?} is listed twice", delegate.value),
            );
            continue;
        }
        delegates.push(delegate.value);
        delegate_lines.push(line);
    }

    let mut approval = BTreeMap::new();
    for (tool, policy) in frontmatter.approval {
        let line = file_line(policy.referenced);
        let policy = policy.value.0;
        if !tools.contains(&tool) {
            let offered = if tools.is_empty() {
                "it lists no tools".to_owned()
            } else {
                format!("its tools are {}", tools.join(", "))
            };
            report(
                line,
                format!(
                    "approval policy for tool {tool:?}, which this agent does not list; {offered}"
                ),
            );
        }
        if let Err(why) = policy.validate() {
            report(line, format!("approval policy for tool {tool:?}: {why}"));
        }
        approval.insert(tool, policy);
    }

    let completion = frontmatter.completion.map(|spec| {
        let line = file_line(spec.referenced);
        let spec = spec.value;
        for tool in spec.require_tools.iter().filter(|t| !tools.contains(t)) {
            report(
                line,
                format!("completion requires tool {tool:?}, which this agent does not list"),
            );
        }
        if spec.require_fields.iter().any(|f| f.split('.').any(str::is_empty)) {
            report(
                line,
                "completion requires a field with an empty name; expected names like `summary` or `report.title`".into(),
            );
        }
        ratchet_core::CompletionCriteria::from(spec)
    });

    let system_prompt = split.body.trim().to_owned();
    if system_prompt.is_empty() {
        report(
            Some(split.body_line),
            "expected the agent's system prompt after the frontmatter, found an empty body".into(),
        );
    }

    let hash = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let definition = AgentDefinition {
        id,
        description,
        model,
        tools,
        delegates,
        limits: frontmatter.limits,
        approval,
        signal: frontmatter.signal.map(Into::into),
        completion,
        system_prompt,
        hash,
        path: path.to_path_buf(),
    };
    let parsed = Parsed {
        definition,
        id_line,
        delegate_lines,
    };
    (Some(parsed), problems)
}

/// A scripted model's file, relative to the catalog, as an absolute path; other specs as
/// written.
fn resolve_model(spec: &str, dir: &Path) -> Result<String, String> {
    let Some(file) = spec
        .strip_prefix("scripted:")
        .filter(|file| *file != "demo")
    else {
        return Ok(spec.to_owned());
    };
    let looked_for = dir.join(file);
    let absolute = looked_for.canonicalize().map_err(|error| {
        format!(
            "expected the scripted model's file {file:?} beside the definition, found none at \
             {}: {error}",
            looked_for.display()
        )
    })?;
    if !absolute.is_file() {
        return Err(format!(
            "expected the scripted model's file {file:?} to be a regular file, found something \
             else at {}",
            absolute.display()
        ));
    }
    let absolute = absolute.to_str().ok_or_else(|| {
        format!(
            "the scripted model's file {} has a path that is not UTF-8",
            absolute.display()
        )
    })?;
    Ok(format!("scripted:{absolute}"))
}
