//! The PostgreSQL backend's tests against a real server, one binary: the store conformance
//! suite, and what only PostgreSQL has.

mod conformance;
mod postgres;
