//! `ratchet --version` names the package version and the commit the binary was built from, so
//! a running deployment can be traced to its source.

use std::process::Command;

use crate::common::{output_within_deadline, stderr_of, stdout_of};

/// What `git` says of HEAD in this checkout (`abc1234 2026-12-07`), or `None` outside one.
fn head_commit() -> Option<String> {
    let output = Command::new("git")
        .args(["log", "-1", "--format=%h %cs"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?.trim().to_owned();
    (output.status.success() && !text.is_empty()).then_some(text)
}

#[test]
fn version_names_the_package_version_and_the_commit() {
    let output = output_within_deadline(
        Command::new(env!("CARGO_BIN_EXE_ratchet")).arg("--version"),
        "",
    );
    assert!(output.status.success(), "{}", stderr_of(&output));
    let printed = stdout_of(&output);
    let prefix = format!("ratchet {} (", env!("CARGO_PKG_VERSION"));
    let commit = printed
        .trim_end()
        .strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("expected `{prefix}COMMIT)`, got {printed:?}"));
    match head_commit() {
        // Built in this checkout, the binary names the commit checked out now: the build
        // script reruns when HEAD moves.
        Some(head) => assert_eq!(commit, head),
        None => assert!(!commit.is_empty(), "an empty commit in {printed:?}"),
    }
}
