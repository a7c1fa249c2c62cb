//! `--sqlite-synchronous`: SQLite's `synchronous` setting, `full` by
//! default, `normal` by choice (a commit survives a crash of shop, not a
//! power loss). The setting reaching every connection is a unit test
//! (`db::tests`); here, the flag as an operator meets it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{pay, read, Db, Shop, BODY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn normal_takes_payments_once_each_and_replays_them() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--sqlite-synchronous", "normal"]).await;
    let client = common::signed_in();
    let first = read(pay(&client, &shop, Some("sync-1"), BODY)).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = read(pay(&client, &shop, Some("sync-1"), BODY)).await;
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, first.body);
}

#[test]
fn the_flag_applies_to_a_sqlite_file_alone() {
    let refused = |url: &str, setting: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
            .args(["--listen", "127.0.0.1:0", "--database-url", url])
            .args(["--sqlite-synchronous", setting])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{url} {setting}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let on_postgres = refused("postgres://postgres@127.0.0.1:5432/test", "full");
    assert!(
        on_postgres.contains("--sqlite-synchronous applies to a SQLite --database-url"),
        "{on_postgres}"
    );
    let in_memory = refused("sqlite::memory:", "normal");
    assert!(
        in_memory.contains("does not apply to an in-memory SQLite database"),
        "{in_memory}"
    );
    let unknown = refused("sqlite:x.db", "off");
    assert!(unknown.contains("invalid value 'off'"), "{unknown}");
}
