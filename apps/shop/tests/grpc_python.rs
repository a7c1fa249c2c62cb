//! shop's gRPC API driven by a client not written in Rust: Python's
//! grpcio, with stubs compiled from `proto/shop.proto` itself
//! (`tests/grpc_client.py`). `bash scripts/test` installs grpcio into a
//! virtualenv and names its python in `IDEM_TEST_PYTHON`; without grpcio
//! the test fails, saying so.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{account, signed_in, start_in, Mode, RedisPrefix};
use serde_json::Value;

async fn from_python(mode: Mode) {
    let db = mode.db().await;
    let prefix = RedisPrefix::new("grpc-python");
    let shop = start_in(mode, &db, &prefix.0, &["--grpc-listen", "127.0.0.1:0"]).await;
    let target = shop
        .grpc
        .clone()
        .unwrap()
        .trim_start_matches("http://")
        .to_owned();
    let python = std::env::var("IDEM_TEST_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let dir = env!("CARGO_MANIFEST_DIR");
    let account_id = format!("acc_py_{}", uuid::Uuid::new_v4().simple());
    let mut command = std::process::Command::new(&python);
    command
        .arg(format!("{dir}/tests/grpc_client.py"))
        .args(["--target", &target, "--proto-dir", &format!("{dir}/proto")])
        .args(["--account", &account_id]);
    let run = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot run {python} (set IDEM_TEST_PYTHON): {e}"));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "the Python client failed: {stderr}");
    let seen: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stdout)));

    assert_eq!(seen["missing_key"], "INVALID_ARGUMENT", "{seen}");
    assert_eq!(seen["unauthenticated"], "UNAUTHENTICATED", "{seen}");
    assert_eq!(seen["invalid_amount"], "INVALID_ARGUMENT", "{seen}");
    let payment = &seen["replay"];
    assert_eq!(payment["account_id"], account_id.as_str());
    assert_eq!(payment["amount"], 1250);
    assert_eq!(payment["status"], "authorized");
    assert_eq!(payment["operation_id"].as_str().unwrap().len(), 36);
    assert_eq!(seen["replay_marked"], "true", "{seen}");
    assert_eq!(&seen["gzip_replay"], payment, "{seen}");
    assert_eq!(seen["gzip_replay_marked"], "true", "{seen}");
    let race = seen["race"].as_array().unwrap();
    assert_eq!(race.len(), 8);
    assert!(race.iter().all(|p| p == payment), "{seen}");
    assert_eq!(seen["race_fresh"], 1, "one call ran: {seen}");
    assert_eq!(seen["reused_key"], "FAILED_PRECONDITION", "{seen}");
    assert_eq!(&seen["get"], payment);
    assert_eq!(seen["get_other_client"], "NOT_FOUND", "{seen}");

    let acc = account(&signed_in(), &shop, &account_id).await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "{acc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_client_on_sqlite() {
    from_python(Mode::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_client_on_postgres() {
    from_python(Mode::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_client_on_mysql() {
    from_python(Mode::Mysql).await;
}
