//! The embedded SQLite store for idem.
//!
//! One process, no server: the database file is created if missing, put in
//! WAL mode with a busy timeout, and migrated on [`SqliteStore::connect`].
//! Handlers that write to the same database complete the idempotency
//! record **in their own transaction** ([`SqliteStore::complete_in`]), so
//! that the business write and the record commit together or not at all.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store, StoredResponse};
//! use idem_sqlite::SqliteStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! let request = ClaimRequest {
//!     scope: "client-1".into(),
//!     key: "key-1".into(),
//!     fingerprint: Fingerprint::of_request("POST", "/payments", None, b"{}"),
//!     lease: Duration::from_secs(30),
//!     retention: Duration::from_secs(86_400),
//! };
//! let ClaimOutcome::Acquired(claim) = store.claim(&request).await? else { unreachable!() };
//!
//! // The write transaction on the store's writers' pool: this process's
//! // writers queue there in order, rather than sleep while the file is locked.
//! let mut tx = store.writers().begin_with("BEGIN IMMEDIATE").await?;
//! // ... the business write on `tx` ...
//! let response = StoredResponse { status: 201, headers: vec![], body: "{}".into() };
//! store.complete_in(&mut tx, &claim, &response).await?; // fenced by the claim's token
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! The store is [`idem_sql::SqlStore`] on the [`Sqlite`] dialect: the claim
//! and why it is atomic are written once there, for SQLite and MySQL.

pub use idem_sql::dialect::{
    sqlite_connect_options as connect_options, sqlite_pool as open_pool,
    SQLITE_BUSY_TIMEOUT as DEFAULT_BUSY_TIMEOUT,
};
pub use idem_sql::{is_unavailable, store_error, SqlRecords, Sqlite, TableName};

/// The SQLite store; see the crate-level docs.
pub type SqliteStore = idem_sql::SqlStore<Sqlite>;

/// Applies idem's migrations of the records' table on `pool` (see
/// [`idem_sql::migrate`]).
pub async fn migrate(pool: &sqlx::SqlitePool) -> Result<(), idem_sql::MigrateError> {
    idem_sql::migrate::migrate::<Sqlite>(pool, &TableName::default(), SqliteStore::migrations())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn fresh() -> (SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("idem.db").display());
        (SqliteStore::connect(&url).await.expect("connect"), dir)
    }

    mod suite {
        // Each case gets its own database file, removed when the case ends.
        idem_store_suite::store_suite!(|| super::fresh());
    }

    mod transactional {
        idem_store_suite::transactional_suite!(|| async {
            let (store, dir) = super::fresh().await;
            let pool = store.pool().clone();
            (store, pool, dir)
        });
    }

    #[tokio::test]
    async fn migrations_are_idempotent_and_the_file_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested.db");
        let url = format!("sqlite:{}", path.display());
        let a = SqliteStore::connect(&url).await.unwrap();
        assert!(path.exists());
        a.migrate().await.unwrap();
        let b = SqliteStore::connect(&url).await.unwrap();
        let v: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_schema_migrations")
            .fetch_one(b.pool())
            .await
            .unwrap();
        assert_eq!(v, SqliteStore::migrations().len() as i64);
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(b.pool())
            .await
            .unwrap();
        assert_eq!(mode, "wal");
    }

    /// Every statement is a round trip to its connection's thread: neither
    /// the readers' pool nor the writers' adds one more (a ping) before
    /// handing a connection out. On the readers' pool that ping was a
    /// third of a replay's round trips.
    #[tokio::test]
    async fn connections_are_handed_out_without_a_ping_first() {
        let (store, _dir) = fresh().await;
        assert!(!store.pool().options().get_test_before_acquire());
        assert!(!store.writers().options().get_test_before_acquire());
        // and the pool still answers after many checkouts
        for _ in 0..50 {
            let one: i64 = sqlx::query_scalar("SELECT 1")
                .fetch_one(store.pool())
                .await
                .unwrap();
            assert_eq!(one, 1);
        }
    }

    #[tokio::test]
    async fn a_bad_url_is_an_error_not_a_panic() {
        assert!(SqliteStore::connect("sqlite:/nonexistent-dir/x/y.db")
            .await
            .is_err());
        assert!(SqliteStore::connect("postgres://nope").await.is_err());
    }

    /// This process's writers queue for the store's writers' connection,
    /// each woken when the one before it is done, so none finds the file
    /// locked: even with no busy timeout at all (SQLite then refuses a
    /// locked file at once), every one of many racing claims and business
    /// transactions, each holding the lock a moment, goes through, and
    /// each effect is written once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn writers_queue_in_the_process_instead_of_finding_the_file_locked() {
        use idem_core::{
            ClaimOutcome, ClaimRequest, Fingerprint, RecordState, Store, StoredResponse,
        };
        use std::time::Duration;

        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("idem.db").display());
        let options = connect_options(&url)
            .expect("options")
            .busy_timeout(Duration::ZERO);
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .expect("pool");
        let store = SqliteStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        sqlx::query("CREATE TABLE effects (key TEXT PRIMARY KEY)")
            .execute(store.writers())
            .await
            .expect("table");
        let response = StoredResponse {
            status: 201,
            headers: vec![],
            body: "{}".into(),
        };
        let racers = (0..32).map(|n| {
            let (store, response) = (store.clone(), response.clone());
            tokio::spawn(async move {
                let request = ClaimRequest {
                    scope: "client-1".into(),
                    key: format!("key-{n}"),
                    fingerprint: Fingerprint::of_request("POST", "/payments", None, b"{}"),
                    lease: Duration::from_secs(60),
                    retention: Duration::from_secs(86_400),
                };
                let ClaimOutcome::Acquired(claim) = store.claim(&request).await? else {
                    return Err("a fresh key was not acquired".into());
                };
                let mut tx = store.writers().begin_with("BEGIN IMMEDIATE").await?;
                sqlx::query("INSERT INTO effects (key) VALUES (?1)")
                    .bind(&request.key)
                    .execute(&mut *tx)
                    .await?;
                // Held a moment, so that others arrive while it is.
                tokio::time::sleep(Duration::from_millis(2)).await;
                store.complete_in(&mut tx, &claim, &response).await?;
                tx.commit().await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(request.key)
            })
        });
        let mut done = Vec::new();
        for racer in racers.collect::<Vec<_>>() {
            done.push(
                racer
                    .await
                    .expect("task")
                    .expect("every writer goes through"),
            );
        }
        let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(effects, 32);
        for key in &done {
            let record = store
                .get("client-1", key)
                .await
                .expect("get")
                .expect("record");
            assert!(
                matches!(record.state, RecordState::Completed { .. }),
                "{key}"
            );
        }
    }

    /// The insert's times are the database's clock as it runs, not the first
    /// look's: a claim that queued behind another writer still holds its whole
    /// lease from when its record was written.
    #[tokio::test]
    async fn a_new_keys_lease_counts_from_when_it_is_written() {
        use idem_core::{ClaimOutcome, Store};
        use std::time::Duration;
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("idem.db").display());
        let store = SqliteStore::connect(&url).await.expect("connect");
        let mut held = store
            .writers()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .expect("the writers' connection");
        let before: i64 = sqlx::query_scalar(
            "SELECT CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)",
        )
        .fetch_one(&mut *held)
        .await
        .expect("clock");
        let claimer = {
            let store = store.clone();
            tokio::spawn(async move {
                let fresh = idem_store_suite::request(
                    "s",
                    "queued",
                    "{}",
                    Duration::from_secs(60),
                    idem_store_suite::LONG,
                );
                store.claim(&fresh).await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!claimer.is_finished(), "the insert waits for the writer");
        held.rollback().await.expect("rollback");
        let ClaimOutcome::Acquired(claim) = claimer.await.expect("task").expect("claim") else {
            panic!("a new key is acquired");
        };
        let record = store
            .get("s", "queued")
            .await
            .expect("get")
            .expect("record");
        assert!(
            record.created_at.0 - before >= 300,
            "written at {}, the writer was free from {} on",
            record.created_at.0,
            before + 300
        );
        assert_eq!(claim.locked_until.0, record.created_at.0 + 60_000);
    }

    /// A store made outside a Tokio runtime, from a pool opened in one (a
    /// synchronous `main`), is made, and works in that runtime: before,
    /// making its writers' pool panicked.
    #[test]
    fn a_store_made_outside_a_runtime_works_inside_it() {
        use idem_core::{ClaimOutcome, Store};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("idem.db").display());
        let pool = runtime.block_on(open_pool(&url)).expect("pool");
        let store = SqliteStore::from_pool(pool);
        runtime.block_on(async {
            store.migrate().await.expect("migrate");
            let fresh = idem_store_suite::request(
                "s",
                "k",
                "{}",
                idem_store_suite::LONG,
                idem_store_suite::LONG,
            );
            assert!(matches!(
                store.claim(&fresh).await.expect("claim"),
                ClaimOutcome::Acquired(_)
            ));
        });
    }

    /// The writers' connection is opened with the pool's own hooks: an
    /// application's `after_connect` (a pragma, a function it registers)
    /// holds on the connection its writes run on too.
    #[tokio::test]
    async fn the_writers_connection_runs_the_pools_hooks() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite:{}", dir.path().join("idem.db").display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // A setting of the connection, not of the file.
                    sqlx::query("PRAGMA cache_size = -4321")
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            })
            .connect_with(connect_options(&url).expect("options"))
            .await
            .expect("pool");
        let store = SqliteStore::from_pool(pool);
        let cache: i64 = sqlx::query_scalar("PRAGMA cache_size")
            .fetch_one(store.writers())
            .await
            .expect("pragma");
        assert_eq!(cache, -4321);
    }

    #[tokio::test]
    async fn a_schema_is_refused_with_a_clear_error() {
        let pool = open_pool("sqlite::memory:").await.unwrap();
        let table = TableName::new(Some("billing"), "idem_records").unwrap();
        let err = SqliteStore::new(pool, table).unwrap_err();
        let source = format!("{err:?}");
        assert!(source.contains("SQLite has no schemas"), "{source}");
    }
}
