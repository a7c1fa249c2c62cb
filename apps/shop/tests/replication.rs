//! shop reads its PostgreSQL primary's replication at start: with an
//! asynchronous standby it refuses `--claim-in-transaction` (a failover
//! could lose answered records), unless told `--allow-async-standby`; with
//! a synchronous one it starts. What each setting keeps through a failover
//! is measured by the history checker (`history.rs`, `failover_*`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pgpair::{PgPair, Replication};
use common::{Db, Shop};

/// Runs shop with `flags` on `url` and returns its exit status and stderr,
/// or `None` if it was still running (serving) after a while.
fn exits(url: &str, flags: &[&str]) -> Option<(bool, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--listen", "127.0.0.1:0", "--database-url", url])
        .args(flags)
        .env("SHOP_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return Some((status.success(), err));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_in_transaction_refuses_an_asynchronous_standby() {
    let pair = PgPair::start(Replication::Asynchronous).await;
    let url = pair.primary_url();
    let (ok, err) = exits(&url, &["--claim-in-transaction"]).expect("shop refused and exited");
    assert!(!ok);
    assert!(
        err.contains("refusing --claim-in-transaction") && err.contains("--allow-async-standby"),
        "{err}"
    );
    // Told to, it starts; the default mode starts (with a warning).
    let db = Db::PostgresAt(url);
    let _allowed = Shop::start(&db, &["--claim-in-transaction", "--allow-async-standby"]).await;
    let _default = Shop::start(&db, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_in_transaction_starts_with_a_synchronous_standby() {
    let pair = PgPair::start(Replication::Synchronous).await;
    let db = Db::PostgresAt(pair.primary_url());
    let _shop = Shop::start(&db, &["--claim-in-transaction"]).await;
}

/// Commits `tx` while the synchronous standby is held back: it must still
/// be waiting after `wait` (PostgreSQL ends a commit's wait for its standby
/// early on a cancel, a `statement_timeout` among them, and reports the
/// commit done with a warning: "committed locally, but might not have been
/// replicated"; an answer given then is lost with the primary in a
/// failover). Once the standby is back the commit completes, replicated.
async fn the_commit_waits_for_the_standby(
    pair: &PgPair,
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    what: &str,
) {
    use idem_test_support::faults::Fault;
    sqlx::query("INSERT INTO effects VALUES ($1)")
        .bind(what)
        .execute(&mut *tx)
        .await
        .unwrap();
    pair.replication.set(Fault::Partition);
    let commit = tokio::spawn(tx.commit());
    // Well past every time bound the transaction was given (1 s at most).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        !commit.is_finished(),
        "{what}: the commit returned ({:?}) while the synchronous standby had not got it",
        commit.await
    );
    pair.replication.set(Fault::None);
    commit.await.unwrap().unwrap();
    let standby = sqlx::PgPool::connect(&pair.standby_url()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE what = $1")
            .bind(what)
            .fetch_one(&standby)
            .await
            .unwrap();
        if n == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never replayed on the standby"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    standby.close().await;
}

/// The time bounds idem puts on a transaction on the server (a claim held
/// by the transaction: its lease; a write bounded by a time-out, as shop's
/// and the inbox's) never cut a commit's wait for a synchronous standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_transactions_never_cut_the_wait_for_a_synchronous_standby() {
    use idem_core::{ClaimInTransaction, TxClaimOutcome};
    use idem_sql::dialect::Dialect;
    let pair = PgPair::start(Replication::Synchronous).await;
    let url = pair.primary_url();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE effects (what text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();

    let tx = idem_sql::Postgres::begin_write_bounded(&pool, Duration::from_millis(500))
        .await
        .unwrap();
    the_commit_waits_for_the_standby(&pair, tx, "a write bounded by 500 ms").await;

    let store = idem_postgres::PostgresStore::connect(&url).await.unwrap();
    let request = idem_core::ClaimRequest {
        scope: "s".into(),
        key: "k".into(),
        fingerprint: idem_core::Fingerprint::of_request("POST", "/p", None, b"{}"),
        lease: Duration::from_secs(1),
        retention: Duration::from_secs(3600),
    };
    let TxClaimOutcome::Acquired { transaction, .. } =
        store.claim_and_begin(&request).await.unwrap()
    else {
        panic!("a new key")
    };
    the_commit_waits_for_the_standby(&pair, transaction, "a claim held under a 1 s lease").await;
    pool.close().await;
}
