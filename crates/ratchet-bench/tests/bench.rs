//! The benchmark program on its own, as `cargo run -p ratchet-bench` runs it. The benchmarks
//! themselves are run through `ratchet bench` by ratchet-cli's tests (`bench` module), which
//! also need this binary built beside `ratchet`: this test target is what builds it.

use std::process::Command;

use serde_json::Value;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ratchet-bench"))
        .args(args)
        .env_remove("RATCHET_LOG")
        .output()
        .expect("cannot start ratchet-bench")
}

#[test]
fn commits_prints_one_report_of_the_commits_it_made() {
    let output = bench(&["commits", "--count", "20", "--json"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(report["commits"], 20, "{report}");
    assert!(
        report["commits_per_s"]
            .as_f64()
            .is_some_and(|rate| rate > 0.0),
        "{report}"
    );
}

#[test]
fn an_unknown_benchmark_is_a_usage_error_naming_the_known_ones() {
    let output = bench(&["throughput"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("unrecognized subcommand 'throughput'"),
        "{stderr}"
    );
    let help = bench(&["--help"]);
    let listed = String::from_utf8_lossy(&help.stdout);
    for known in ["commits", "steps", "recovery", "memory", "sse"] {
        assert!(listed.contains(known), "{known} in {listed}");
    }
}
