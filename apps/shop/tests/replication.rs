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
