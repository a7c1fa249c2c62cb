//! A PostgreSQL schema of its own for each test, dropped afterwards.
//!
//! Tests read the server's URL from `IDEM_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`, the one `scripts/test` makes
//! sure is up). A test that cannot connect fails; it is never skipped.

use sqlx::{Connection, PgConnection};

/// The URL of the test server.
pub fn database_url() -> String {
    std::env::var("IDEM_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A fresh schema, dropped (with everything in it) when this is dropped.
#[derive(Debug)]
pub struct TestSchema {
    name: String,
    base_url: String,
}

impl TestSchema {
    /// Creates a schema with a unique name starting with `prefix`.
    ///
    /// # Panics
    ///
    /// If the server cannot be reached: a test that needs PostgreSQL fails
    /// without it.
    pub async fn create(prefix: &str) -> Self {
        let base_url = database_url();
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&base_url).await.unwrap_or_else(|e| {
            panic!("cannot connect to PostgreSQL at {base_url} (set IDEM_TEST_DATABASE_URL; `bash scripts/test` starts the server): {e}")
        });
        sqlx::raw_sql(&format!("CREATE SCHEMA \"{name}\""))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("cannot create schema {name}: {e}"));
        let _ = conn.close().await;
        Self { name, base_url }
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A URL whose connections use this schema first (`search_path`), so
    /// unqualified table names land in it.
    pub fn url(&self) -> String {
        let sep = if self.base_url.contains('?') {
            '&'
        } else {
            '?'
        };
        format!(
            "{}{sep}options=-c%20search_path%3D{}",
            self.base_url, self.name
        )
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let url = self.base_url.clone();
        let name = self.name.clone();
        let dropped = crate::cleanup(move || async move {
            let mut conn = PgConnection::connect(&url).await.ok()?;
            // Never hang a test run on a lock some leaked transaction holds.
            sqlx::raw_sql("SET lock_timeout = '10s'")
                .execute(&mut conn)
                .await
                .ok()?;
            sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                .execute(&mut conn)
                .await
                .ok()?;
            conn.close().await.ok()
        });
        if !dropped {
            eprintln!("warning: could not drop test schema {}", self.name);
        }
    }
}
