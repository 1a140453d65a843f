//! Loading a catalog directory: which files are definitions, reading each safely, and the
//! checks across files (unique ids, known delegates, no delegation cycle). Every problem is
//! collected; any one of them rejects the whole catalog.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::file::{self, Parsed};
use crate::{AgentDefinition, Known, Problem};

/// Largest definition file read: a prompt is text a person wrote, not data.
pub const MAX_FILE_BYTES: u64 = 256 * 1024;

/// The agents of one directory, by id.
#[derive(Debug, Clone)]
pub struct Catalog {
    dir: PathBuf,
    agents: BTreeMap<String, AgentDefinition>,
}

impl Catalog {
    /// Reads every `*.md` file of `dir` (not its subdirectories). Either every definition is
    /// valid and the catalog holds them all, or every problem found is returned, sorted by
    /// file and line.
    pub fn load(dir: &Path, known: &dyn Known) -> Result<Catalog, Vec<Problem>> {
        let dir = std::path::absolute(dir).map_err(|error| {
            vec![problem(
                dir,
                None,
                format!("expected a catalog directory, found a path that cannot be made absolute: {error}"),
            )]
        })?;
        let (canonical, files) = definition_files(&dir).map_err(|p| vec![p])?;
        let mut problems = Vec::new();
        let mut parsed = Vec::new();
        let mut definitions = 0;
        for path in files {
            match read_definition(&path, &canonical) {
                Ok(None) => {}
                Ok(Some(bytes)) => {
                    definitions += 1;
                    let (file, found) = file::parse(&path, &dir, &bytes, known);
                    problems.extend(found);
                    parsed.extend(file);
                }
                Err(found) => {
                    definitions += 1;
                    problems.push(found);
                }
            }
        }
        if definitions == 0 {
            problems.push(problem(
                &dir,
                None,
                "expected agent definitions (`*.md` files) in the catalog directory, found \
                 none: an empty catalog has nothing to serve"
                    .into(),
            ));
        }
        problems.extend(across_files(&parsed));
        if !problems.is_empty() {
            problems.sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
            return Err(problems);
        }
        let agents = parsed
            .into_iter()
            .map(|p| (p.definition.id.clone(), p.definition))
            .collect();
        Ok(Catalog { dir, agents })
    }

    pub fn get(&self, id: &str) -> Option<&AgentDefinition> {
        self.agents.get(id)
    }

    /// Every agent, in id order.
    pub fn agents(&self) -> impl Iterator<Item = &AgentDefinition> {
        self.agents.values()
    }

    /// The catalog's directory, absolute.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn problem(file: &Path, line: Option<usize>, message: String) -> Problem {
    Problem {
        file: file.to_path_buf(),
        line,
        message,
    }
}

/// The directory's canonical path (symlinks are judged against it) and its `*.md` entries
/// in name order.
fn definition_files(dir: &Path) -> Result<(PathBuf, Vec<PathBuf>), Problem> {
    let unreadable = |error: std::io::Error| {
        let message = if error.kind() == std::io::ErrorKind::NotFound {
            "expected a catalog directory, found nothing at this path".to_owned()
        } else {
            format!("expected a readable catalog directory: {error}")
        };
        problem(dir, None, message)
    };
    let metadata = std::fs::metadata(dir).map_err(unreadable)?;
    if !metadata.is_dir() {
        return Err(problem(
            dir,
            None,
            "expected a catalog directory, found a file".into(),
        ));
    }
    let canonical = dir.canonicalize().map_err(unreadable)?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(unreadable)? {
        let path = entry.map_err(unreadable)?.path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files.sort();
    Ok((canonical, files))
}

/// A definition's bytes; `None` for a directory (subdirectories are not part of a catalog).
fn read_definition(path: &Path, canonical_dir: &Path) -> Result<Option<Vec<u8>>, Problem> {
    let fail = |message: String| problem(path, None, message);
    let link = std::fs::symlink_metadata(path)
        .map_err(|e| fail(format!("cannot read the file's metadata: {e}")))?;
    if link.is_symlink() {
        let target = path
            .canonicalize()
            .map_err(|e| fail(format!("expected a symlink to an existing file: {e}")))?;
        if !target.starts_with(canonical_dir) {
            return Err(fail(format!(
                "expected a symlink to a file inside the catalog directory, found one to {}",
                target.display()
            )));
        }
    }
    let metadata = std::fs::metadata(path)
        .map_err(|e| fail(format!("cannot read the file's metadata: {e}")))?;
    if metadata.is_dir() {
        return Ok(None);
    }
    let too_large = |size: u64| {
        fail(format!(
            "expected at most {MAX_FILE_BYTES} bytes (256 KiB) in a definition, found {size}"
        ))
    };
    if metadata.len() > MAX_FILE_BYTES {
        return Err(too_large(metadata.len()));
    }
    let file = std::fs::File::open(path).map_err(|e| fail(format!("cannot open the file: {e}")))?;
    let mut bytes = Vec::new();
    // The file may have grown since its size was read: never read more than one byte past
    // the limit.
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot read the file: {e}")))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(Some(bytes))
}

/// Duplicate ids, unknown delegates and delegation cycles.
fn across_files(parsed: &[Parsed]) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut first_by_folded_id: BTreeMap<String, &Parsed> = BTreeMap::new();
    for file in parsed {
        let definition = &file.definition;
        let folded = definition.id.to_lowercase();
        match first_by_folded_id.get(&folded) {
            Some(first) => problems.push(problem(
                &definition.path,
                file.id_line,
                format!(
                    "expected a unique agent id (compared ignoring case), found {:?}, which {} \
                     already defines as {:?}",
                    definition.id,
                    first.definition.path.display(),
                    first.definition.id,
                ),
            )),
            None => {
                first_by_folded_id.insert(folded, file);
            }
        }
    }
    // The first file of an id stands for it; a duplicate is already a problem.
    let by_id: BTreeMap<&str, &Parsed> = first_by_folded_id
        .values()
        .map(|file| (file.definition.id.as_str(), *file))
        .collect();
    let ids: Vec<&str> = by_id.keys().copied().collect();
    for file in parsed {
        let definition = &file.definition;
        for (delegate, line) in definition.delegates.iter().zip(&file.delegate_lines) {
            if !by_id.contains_key(delegate.as_str()) {
                problems.push(problem(
                    &definition.path,
                    *line,
                    format!(
                        "unknown delegate {delegate:?}: expected the id of an agent of this \
                         catalog ({})",
                        ids.join(", ")
                    ),
                ));
            }
        }
    }
    let graph: BTreeMap<&str, Vec<&str>> = by_id
        .iter()
        .map(|(id, file)| {
            let delegates = file
                .definition
                .delegates
                .iter()
                .map(String::as_str)
                .filter(|d| by_id.contains_key(d))
                .collect();
            (*id, delegates)
        })
        .collect();
    for cycle in cycles(&graph) {
        let file = by_id[cycle[0]];
        let line = file
            .definition
            .delegates
            .iter()
            .position(|d| d == cycle[1])
            .and_then(|i| file.delegate_lines[i]);
        problems.push(problem(
            &file.definition.path,
            line,
            format!("delegation cycle: {}", cycle.join(" -> ")),
        ));
    }
    problems
}

/// The cycles a depth-first walk of the delegation graph meets, each once: the ids along it,
/// starting at its smallest and ending where it started. Every graph with a cycle yields at
/// least one. The walk keeps its own stack, so a long chain of delegates cannot overflow the
/// thread's.
fn cycles<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> BTreeSet<Vec<&'a str>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Unvisited,
        OnPath,
        Finished,
    }
    let mut marks: BTreeMap<&str, Mark> = graph.keys().map(|id| (*id, Mark::Unvisited)).collect();
    let mut found = BTreeSet::new();
    for root in graph.keys().copied() {
        if marks[root] != Mark::Unvisited {
            continue;
        }
        marks.insert(root, Mark::OnPath);
        // Each agent on the current path with the index of its next delegate to follow.
        let mut path: Vec<(&str, usize)> = vec![(root, 0)];
        while let Some((id, next)) = path.last_mut() {
            let id = *id;
            let Some(delegate) = graph[id].get(*next).copied() else {
                marks.insert(id, Mark::Finished);
                path.pop();
                continue;
            };
            *next += 1;
            match marks[delegate] {
                Mark::Unvisited => {
                    marks.insert(delegate, Mark::OnPath);
                    path.push((delegate, 0));
                }
                Mark::OnPath => {
                    let start = path
                        .iter()
                        .position(|(on, _)| *on == delegate)
                        .expect("an agent marked on the path is on it");
                    let mut cycle: Vec<&str> = path[start..].iter().map(|(on, _)| *on).collect();
                    let smallest = (0..cycle.len())
                        .min_by_key(|i| cycle[*i])
                        .expect("a cycle has at least one agent");
                    cycle.rotate_left(smallest);
                    cycle.push(cycle[0]);
                    found.insert(cycle);
                }
                Mark::Finished => {}
            }
        }
    }
    found
}
