//! What a claim sends to SQLite, read from sqlx's statement log: a new key
//! is claimed by the first look and one insert (one statement under the
//! file's write lock), and only a key some row holds takes the claim's
//! transaction. The one test of its binary, since the log's subscriber is
//! global (sqlx logs from the connection's worker thread).

use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use idem_core::{ClaimOutcome, RecordState, Store};
use idem_sqlite::SqliteStore;
use idem_store_suite::{request, LONG};

/// The log, shared between the subscriber's writers and the test.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Log {
    fn buffer(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The statements logged since the last call, one line each, but for
    /// the settings each new connection is opened with.
    fn take(&self) -> Vec<String> {
        let text = String::from_utf8_lossy(&std::mem::take(&mut *self.buffer())).into_owned();
        text.lines()
            .filter(|line| line.contains("sqlx::query") && !line.contains("PRAGMA"))
            .map(str::to_owned)
            .collect()
    }
}

impl Write for Log {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn count(lines: &[String], what: &str) -> usize {
    lines.iter().filter(|line| line.contains(what)).count()
}

#[tokio::test]
async fn a_new_key_is_claimed_by_the_first_look_and_one_insert() {
    let log = Log::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter("sqlx::query=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("idem.db").display());
    let store = SqliteStore::connect(&url).await.expect("connect");
    log.take();

    let fresh = request("s", "new", "{}", Duration::from_secs(60), LONG);
    let ClaimOutcome::Acquired(claim) = store.claim(&fresh).await.expect("claim") else {
        panic!("a new key is acquired");
    };
    let sent = log.take();
    assert_eq!(sent.len(), 2, "the first look and the insert: {sent:#?}");
    assert_eq!(count(&sent, "SELECT"), 1, "{sent:#?}");
    assert_eq!(count(&sent, "RETURNING locked_until"), 1, "{sent:#?}");
    assert_eq!(count(&sent, "ON CONFLICT"), 0, "no upsert: {sent:#?}");
    assert!(!claim.takeover);
    // The lease reported is the one stored, counted from the insert.
    let record = store.get("s", "new").await.expect("get").expect("record");
    assert_eq!(
        record.state,
        RecordState::InProgress {
            token: claim.token,
            locked_until: claim.locked_until
        }
    );
    assert_eq!(record.operation_id, claim.operation_id);
    assert_eq!(claim.locked_until.0 - record.created_at.0, 60_000);

    // A repeat is answered by the first look alone.
    log.take();
    assert!(matches!(
        store.claim(&fresh).await.expect("repeat"),
        ClaimOutcome::Existing(_)
    ));
    assert_eq!(log.take().len(), 1);

    // A record past its retention is found by nobody's first look, and the
    // insert fails on it: the claim's transaction replaces it.
    let short = Duration::from_millis(1);
    let gone = request("s", "gone", "{}", short, short);
    assert!(matches!(
        store.claim(&gone).await.expect("claim"),
        ClaimOutcome::Acquired(_)
    ));
    tokio::time::sleep(Duration::from_millis(20)).await;
    log.take();
    let ClaimOutcome::Acquired(again) = store.claim(&gone).await.expect("again") else {
        panic!("a record past its retention is replaced");
    };
    let sent = log.take();
    // sqlx does not log `BEGIN`: the transaction shows by its upsert and
    // the row read back.
    assert_eq!(sent.len(), 4, "{sent:#?}");
    assert_eq!(count(&sent, "RETURNING locked_until"), 1, "{sent:#?}");
    assert_eq!(count(&sent, "ON CONFLICT"), 1, "then the upsert: {sent:#?}");
    assert!(!again.takeover, "past its retention the record is new");
}
