//! A MySQL / MariaDB database of its own for each test, dropped afterwards.
//!
//! Tests read the server's URL from `IDEM_TEST_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`, the MariaDB `scripts/test` makes
//! sure is up). A test that cannot connect fails; it is never skipped.

use sqlx::{Connection, MySqlConnection};

/// The URL of the test server.
pub fn mysql_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A fresh database, dropped (with everything in it) when this is dropped.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    base_url: String,
}

impl TestDatabase {
    /// Creates a database with a unique name starting with `prefix`.
    ///
    /// # Panics
    ///
    /// If the server cannot be reached: a test that needs MySQL fails
    /// without it.
    pub async fn create(prefix: &str) -> Self {
        let base_url = mysql_url();
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        let mut conn = MySqlConnection::connect(&base_url).await.unwrap_or_else(|e| {
            panic!("cannot connect to MySQL/MariaDB at {base_url} (set IDEM_TEST_MYSQL_URL; `bash scripts/test` starts the server): {e}")
        });
        sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("cannot create database {name}: {e}"));
        let _ = conn.close().await;
        Self { name, base_url }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A URL whose connections use this database.
    pub fn url(&self) -> String {
        let (base, query) = match self.base_url.split_once('?') {
            Some((b, q)) => (b, format!("?{q}")),
            None => (self.base_url.as_str(), String::new()),
        };
        let server = match base.rfind('/') {
            Some(i) if base[..i].ends_with('/') => base,
            Some(i) => &base[..i],
            None => base,
        };
        format!("{}/{}{query}", server.trim_end_matches('/'), self.name)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let url = self.base_url.clone();
        let name = self.name.clone();
        let dropped = crate::cleanup(move || async move {
            let mut conn = MySqlConnection::connect(&url).await.ok()?;
            // Never hang a test run on a lock some leaked transaction holds.
            sqlx::raw_sql("SET SESSION lock_wait_timeout = 10")
                .execute(&mut conn)
                .await
                .ok()?;
            // The test's own connections still open in it (a pool not yet
            // closed, a transaction left open on a busy machine) would hold
            // the drop on their metadata locks until it gives up, leaving
            // the database behind: they are ended first.
            let open: Vec<i64> = sqlx::query_scalar(
                "SELECT CAST(id AS SIGNED) FROM information_schema.processlist WHERE db = ? AND id <> CONNECTION_ID()",
            )
            .bind(&name)
            .fetch_all(&mut conn)
            .await
            .ok()?;
            for id in open {
                // (One that ended meanwhile is no error worth stopping for.)
                let _ = sqlx::raw_sql(&format!("KILL {id}"))
                    .execute(&mut conn)
                    .await;
            }
            sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS `{name}`"))
                .execute(&mut conn)
                .await
                .ok()?;
            conn.close().await.ok()
        });
        if !dropped {
            eprintln!("warning: could not drop test database {}", self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection left inside an open transaction on one of the
    /// database's tables does not keep the database from being dropped.
    #[tokio::test]
    async fn a_database_is_dropped_under_an_open_transaction() {
        let db = TestDatabase::create("idem_drop").await;
        let name = db.name().to_owned();
        let mut held = MySqlConnection::connect(&db.url()).await.unwrap();
        sqlx::raw_sql("CREATE TABLE t (id INT PRIMARY KEY); BEGIN; INSERT INTO t VALUES (1)")
            .execute(&mut held)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        drop(db);
        let mut conn = MySqlConnection::connect(&mysql_url()).await.unwrap();
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = ?",
        )
        .bind(&name)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(left, 0, "left behind after {:?}", started.elapsed());
        drop(held);
    }
}
