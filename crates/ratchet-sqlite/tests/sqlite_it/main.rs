//! The SQLite backend's tests, one binary: the store conformance suite, and what only SQLite
//! has.

mod conformance;
mod sqlite;
