//! The `ratchet` binary's integration tests, one test binary (so the workspace links it once):
//! each module drives real `ratchet` processes, and nextest runs every test in a process of
//! its own.

mod common;

mod agents;
mod bench;
mod chaos;
mod cli;
mod client;
mod console;
mod crash;
mod failpoints;
mod fork;
mod http_fuzz;
mod idempotency;
mod mcp;
mod providers;
mod scale;
mod schedules;
mod seams;
mod serve;
mod subagents;
mod telemetry;
mod tidy;
mod timer;
mod version;
