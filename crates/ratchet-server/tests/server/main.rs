//! The server's integration tests, one binary (so the workspace links it once): the HTTP API
//! through `app()` on a socket of its own per test, backed by SQLite.

mod common;

mod agents;
mod api;
mod bodies;
mod control;
mod fork;
mod idempotency;
mod openapi;
mod schedules;
mod security;
mod webhooks;
