//! Fresh databases for tests, on the server named by `RATCHET_TEST_POSTGRES_URL`.
//!
//! Without that variable (or without the server) a test is skipped, and says so, on a
//! developer's machine; in CI (`CI=true`) it fails instead, so that a misconfigured pipeline
//! cannot pass by testing nothing.

use std::env;

use crate::{PgOptions, off_runtime};

const URL_VARIABLE: &str = "RATCHET_TEST_POSTGRES_URL";

/// A database of its own for one test, dropped (with its connections) when this is.
pub struct TestDatabase {
    server_url: String,
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates an empty database, or returns `None` after printing why the test is skipped.
    ///
    /// # Panics
    ///
    /// In CI when the variable is unset or the server cannot be reached, and anywhere when
    /// the server is reached but the database cannot be created.
    pub fn create() -> Option<TestDatabase> {
        let in_ci = env::var("CI").is_ok_and(|value| value == "true");
        let Ok(server_url) = env::var(URL_VARIABLE) else {
            assert!(!in_ci, "{URL_VARIABLE} must be set in CI");
            eprintln!("skipped: {URL_VARIABLE} is not set");
            return None;
        };
        let connector = PgOptions::from_url(&server_url)
            .unwrap_or_else(|e| panic!("{URL_VARIABLE} is not a usable url: {e}"))
            .connector();
        let name = format!("ratchet_test_{}", uuid::Uuid::now_v7().simple());
        let created = off_runtime(|| -> crate::Result<()> {
            let mut client = connector.connect()?;
            client
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .unwrap_or_else(|e| panic!("cannot create test database {name}: {e}"));
            Ok(())
        });
        if let Err(error) = created {
            assert!(!in_ci, "{URL_VARIABLE} cannot be reached in CI: {error}");
            eprintln!("skipped: {URL_VARIABLE} cannot be reached: {error}");
            return None;
        }
        let url = with_database(&server_url, &name);
        Some(TestDatabase {
            server_url,
            name,
            url,
        })
    }

    /// The url of this database (the server's url with the database replaced).
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let dropped = off_runtime(|| {
            let mut client = PgOptions::from_url(&self.server_url)?
                .connector()
                .connect()?;
            client
                .batch_execute(&format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    self.name
                ))
                .map_err(|e| crate::backend_error(&e))
        });
        if let Err(error) = dropped {
            eprintln!("cannot drop test database {}: {error}", self.name);
        }
    }
}

/// `url` with its database (the path) replaced by `name`, its options kept.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    format!("{}/{name}{query}", &base[..path_start])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_database_keeps_the_server_and_its_options() {
        assert_eq!(
            with_database("postgres://u@h:5432/test?sslmode=disable", "x"),
            "postgres://u@h:5432/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
        assert_eq!(with_database("postgres://u@h/", "x"), "postgres://u@h/x");
    }
}
