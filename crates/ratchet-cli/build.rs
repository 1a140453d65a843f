//! Names the commit `ratchet --version` was built from, as `RATCHET_BUILD_COMMIT`: the short
//! hash and date from git, else `RATCHET_GIT_COMMIT` (a build without `.git`, such as the
//! container image's), else `unknown`. It never fails the build: a binary that cannot say its
//! commit is still a working binary.

use std::path::{Path, PathBuf};
use std::process::Command;

const COMMIT_VARIABLE: &str = "RATCHET_GIT_COMMIT";

fn main() {
    let manifest_dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    println!("cargo:rerun-if-env-changed={COMMIT_VARIABLE}");
    for path in git_files_naming_the_commit(&manifest_dir) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let commit = commit_from_git(&manifest_dir)
        .or_else(|| {
            std::env::var(COMMIT_VARIABLE)
                .ok()
                .map(|value| value.trim().to_owned())
                .filter(|value| !value.is_empty())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=RATCHET_BUILD_COMMIT={commit}");
}

/// `abc1234 2026-12-07`: the short hash of HEAD and its commit date.
fn commit_from_git(dir: &Path) -> Option<String> {
    git(dir, &["log", "-1", "--format=%h %cs"])
}

/// The files whose change means HEAD names another commit: HEAD itself, the branch it points
/// to, and `packed-refs` for a branch that has no file of its own. In a worktree, HEAD lives in
/// the worktree's git directory and the branches in the shared one; `--git-path` resolves both.
/// Only existing files are named, because cargo runs the script on every build for a missing
/// one.
fn git_files_naming_the_commit(dir: &Path) -> Vec<PathBuf> {
    let mut names = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
    names.extend(git(dir, &["symbolic-ref", "-q", "HEAD"]));
    names
        .iter()
        .filter_map(|name| git(dir, &["rev-parse", "--git-path", name]))
        .map(|path| dir.join(path))
        .filter(|path| path.exists())
        .collect()
}

/// Trimmed stdout of `git ARGS` run in `dir`, or `None` when git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?.trim().to_owned();
    (!text.is_empty()).then_some(text)
}
