//! Racing creates and transitions against real SQLite and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use idem_sql::{create_once, transition, Created, Transition};
use idem_test_support::postgres::TestSchema;

type Order = (String, String, String); // id, client_reference, status

/// Generates the race tests for one backend: `$pool` is an expression
/// giving `(pool, guard)`.
macro_rules! races {
    ($m:ident, $conn:ty, $setup:expr) => {
        mod $m {
            use super::*;

            async fn place(conn: &mut $conn, reference: &str, id: &str) -> Result<Created<Order>, sqlx::Error> {
                create_once(
                    conn,
                    || {
                        sqlx::query_as(
                            "INSERT INTO orders (id, client_reference, status) VALUES ($1, $2, 'placed')
                             ON CONFLICT (client_reference) DO NOTHING RETURNING id, client_reference, status",
                        )
                        .bind(id)
                        .bind(reference)
                    },
                    || {
                        sqlx::query_as("SELECT id, client_reference, status FROM orders WHERE client_reference = $1")
                            .bind(reference)
                    },
                )
                .await
            }

            async fn ship(conn: &mut $conn, id: &str) -> Result<Transition<Order>, sqlx::Error> {
                transition(
                    conn,
                    "shipped",
                    |o: &Order| o.2.clone(),
                    || {
                        sqlx::query_as(
                            "UPDATE orders SET status = 'shipped' WHERE id = $1 AND status = 'placed'
                             RETURNING id, client_reference, status",
                        )
                        .bind(id)
                    },
                    || sqlx::query_as("SELECT id, client_reference, status FROM orders WHERE id = $1").bind(id),
                )
                .await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn fifty_racing_creates_make_one_row_and_agree_on_it() {
                let (pool, _guard) = $setup.await;
                let mut tasks = Vec::new();
                for i in 0..50 {
                    let pool = pool.clone();
                    tasks.push(tokio::spawn(async move {
                        let mut conn = pool.acquire().await.unwrap();
                        place(&mut conn, "ref-1", &format!("order-{i}")).await.unwrap()
                    }));
                }
                let mut created = 0;
                let mut ids = std::collections::HashSet::new();
                for t in tasks {
                    let outcome = t.await.unwrap();
                    created += usize::from(outcome.is_created());
                    ids.insert(outcome.into_inner().0);
                }
                assert_eq!(created, 1, "exactly one caller creates");
                assert_eq!(ids.len(), 1, "every caller gets the same order: {ids:?}");
                let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(&pool).await.unwrap();
                assert_eq!(rows, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn racing_transitions_apply_once() {
                let (pool, _guard) = $setup.await;
                {
                    let mut conn = pool.acquire().await.unwrap();
                    place(&mut conn, "ref-2", "o-2").await.unwrap();
                }
                let mut tasks = Vec::new();
                for _ in 0..30 {
                    let pool = pool.clone();
                    tasks.push(tokio::spawn(async move {
                        let mut conn = pool.acquire().await.unwrap();
                        ship(&mut conn, "o-2").await.unwrap()
                    }));
                }
                let (mut applied, mut already) = (0, 0);
                for t in tasks {
                    match t.await.unwrap() {
                        Transition::Applied(o) => {
                            applied += 1;
                            assert_eq!(o.2, "shipped");
                        }
                        Transition::AlreadyDone(o) => {
                            already += 1;
                            assert_eq!(o.2, "shipped");
                        }
                        other => panic!("unexpected {other:?}"),
                    }
                }
                assert_eq!((applied, already), (1, 29));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn transitions_explain_why_nothing_changed() {
                let (pool, _guard) = $setup.await;
                let mut conn = pool.acquire().await.unwrap();
                assert!(matches!(ship(&mut conn, "missing").await.unwrap(), Transition::NotFound));
                place(&mut conn, "ref-3", "o-3").await.unwrap();
                sqlx::query("UPDATE orders SET status = 'cancelled' WHERE id = 'o-3'")
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                match ship(&mut conn, "o-3").await.unwrap() {
                    Transition::Conflict { current, row } => {
                        assert_eq!(current, "cancelled");
                        assert_eq!(row.0, "o-3");
                    }
                    other => panic!("expected a conflict, got {other:?}"),
                }
                // inside a transaction, the creation commits with the rest
                let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
                assert!(place(&mut tx, "ref-4", "o-4").await.unwrap().is_created());
                tx.rollback().await.unwrap();
                assert!(place(&mut conn, "ref-4", "o-5").await.unwrap().is_created(), "rolled back, so new again");
            }
        }
    };
}

const SCHEMA: &str = "CREATE TABLE orders (
    id TEXT PRIMARY KEY,
    client_reference TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL
)";

async fn sqlite() -> (sqlx::SqlitePool, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("race.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(10));
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    sqlx::query(SCHEMA).execute(&pool).await.unwrap();
    (pool, dir)
}

async fn postgres() -> (sqlx::PgPool, TestSchema) {
    let schema = TestSchema::create("idem_sql").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&schema.url())
        .await
        .unwrap();
    sqlx::query(SCHEMA).execute(&pool).await.unwrap();
    (pool, schema)
}

races!(on_sqlite, sqlx::SqliteConnection, sqlite());
races!(on_postgres, sqlx::PgConnection, postgres());
