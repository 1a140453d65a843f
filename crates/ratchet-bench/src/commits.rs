//! `ratchet bench commits`: the disk's own limit, measured the way a step is made durable —
//! SQLite in WAL mode with `synchronous=FULL`, one single-row transaction (one fsync) after
//! another, in the kind of scratch directory `bench steps` uses. Durable steps per second
//! divided by this rate shows what group commit gains over committing each write alone
//! (`bench steps` on SQLite measures it too, beside its runs).

use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::json;

use crate::report::print_report;

pub fn commits(count: u32, json: bool) -> anyhow::Result<ExitCode> {
    if count == 0 {
        bail!("--count must be at least 1");
    }
    let scratch = tempfile::tempdir().context("cannot create a scratch directory")?;
    let rate = ratchet_sqlite::single_commit_rate(scratch.path(), count)?;
    let report = json!({"commits": count, "commits_per_s": rate});
    print_report(&report, json, || {
        format!("{count} fsynced single-row commits: {rate:.0} commits/s")
    })
}
