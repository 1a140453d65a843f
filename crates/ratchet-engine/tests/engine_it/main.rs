//! The engine's integration tests, one binary: real stores, scripted models, tools that
//! hang or fail on purpose.

mod heard;

mod delegation;
mod effects;
mod engine;
