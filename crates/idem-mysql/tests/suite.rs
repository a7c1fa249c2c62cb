//! The store conformance suite and the transactional suite against a real
//! MySQL / MariaDB, each case in a database of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use idem_mysql::{open_pool, MySqlStore, SqlRecords, TableName};
use idem_test_support::mysql::TestDatabase;

/// A claim of `key` in scope `s`, with a long lease and a minute's
/// retention.
fn request(key: &str) -> idem_core::ClaimRequest {
    idem_store_suite::request(
        "s",
        key,
        "{}",
        idem_store_suite::LONG,
        std::time::Duration::from_secs(60),
    )
}

async fn fresh() -> (MySqlStore, TestDatabase) {
    let db = TestDatabase::create("idem_store").await;
    let store = MySqlStore::connect(&db.url()).await.expect("connect");
    (store, db)
}

mod suite {
    idem_store_suite::store_suite!(|| super::fresh());
}

mod transactional {
    idem_store_suite::transactional_suite!(|| async {
        let (store, db) = super::fresh().await;
        let pool = store.pool().clone();
        (store, pool, db)
    });
}

#[tokio::test]
async fn a_table_in_another_database_is_created_there_and_kept_apart() {
    let home = TestDatabase::create("idem_home").await;
    let other = TestDatabase::create("idem_other").await;
    let pool = open_pool(&home.url()).await.unwrap();
    let table = TableName::new(Some(other.name()), "billing_records").unwrap();
    let store = MySqlStore::new(pool.clone(), table).unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = 'billing_records'",
    )
    .bind(other.name())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(n, 1);
    let versions: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM `{}`.idem_schema_migrations WHERE checksum IS NOT NULL",
        other.name()
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(versions, MySqlStore::migrations().len() as i64);
}

#[tokio::test]
async fn keys_differing_in_case_are_two_keys() {
    use idem_core::{ClaimOutcome, Store};
    let (store, _db) = fresh().await;
    assert!(matches!(
        store.claim(&request("abc")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        store.claim(&request("ABC")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        store.claim(&request("abc ")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    let scoped = |scope: &str| {
        idem_store_suite::request(
            scope,
            "k",
            "{}",
            idem_store_suite::LONG,
            std::time::Duration::from_secs(60),
        )
    };
    assert!(matches!(
        store.claim(&scoped("tenant")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        store.claim(&scoped("tenant ")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        store.claim(&scoped("Tenant")).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert!(matches!(
        store.claim(&scoped("tenant")).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
}

#[tokio::test]
async fn an_overlong_scope_is_refused_never_truncated() {
    use idem_core::{Store, StoreError};
    let (store, _db) = fresh().await;
    let long = "s".repeat(2049);
    let req = idem_store_suite::request(
        &long,
        "k",
        "{}",
        idem_store_suite::LONG,
        std::time::Duration::from_secs(60),
    );
    let err = store.claim(&req).await.unwrap_err();
    assert!(matches!(err, StoreError::Backend(_)), "{err:?}");
    assert!(format!("{err:?}").contains("2049 bytes"), "{err:?}");
    let fits = "é".repeat(1024);
    let req = idem_store_suite::request(
        &fits,
        "k",
        "{}",
        idem_store_suite::LONG,
        std::time::Duration::from_secs(60),
    );
    assert!(store.claim(&req).await.is_ok());
}

/// A database the URL names that does not exist yet is created on connect,
/// as a SQLite file is.
#[tokio::test]
async fn a_missing_database_is_created_on_connect() {
    let home = TestDatabase::create("idem_home").await;
    let name = format!("idem_fresh_{}", uuid::Uuid::new_v4().simple());
    let url = home.url().replace(home.name(), &name);
    let store = MySqlStore::connect(&url).await.unwrap();
    let found: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = 'idem_records'",
    )
    .bind(&name)
    .fetch_one(store.pool())
    .await
    .unwrap();
    sqlx::query(&format!("DROP DATABASE `{name}`"))
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(found, 1);
}

/// A key never seen is claimed by the first look and one plain insert, not
/// by the claim's transaction: a user who may read and insert records but
/// not update them claims new keys (the transaction's upsert needs
/// `UPDATE`), and a repeat finds the claim in progress with the lease the
/// claim reported. A key whose record is past its retention still goes to
/// the transaction, which that user may not run.
#[tokio::test]
async fn a_new_key_is_claimed_by_one_insert() {
    use idem_core::{ClaimOutcome, RecordState, Store};
    use std::time::Duration;
    let (store, db) = fresh().await;
    let user = format!("idem_ins_{}", &db.name()[db.name().len() - 12..]);
    sqlx::raw_sql(&format!(
        "CREATE USER '{user}'@'%' IDENTIFIED BY 'pw';
         GRANT SELECT, INSERT ON `{}`.idem_records TO '{user}'@'%'",
        db.name()
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let url = db.url().replacen("://root@", &format!("://{user}:pw@"), 1);
    assert!(url.contains(&user), "the test URL names root: {url}");
    let main = store.clone();
    let outcome = async move {
        let limited =
            MySqlStore::new(open_pool(&url).await.unwrap(), TableName::default()).unwrap();
        let req = request("new");
        let ClaimOutcome::Acquired(claim) = limited.claim(&req).await.unwrap() else {
            panic!("a new key is acquired");
        };
        assert!(!claim.takeover);
        let ClaimOutcome::Existing(record) = limited.claim(&req).await.unwrap() else {
            panic!("a repeat finds the claim");
        };
        assert_eq!(
            record.state,
            RecordState::InProgress {
                token: claim.token,
                locked_until: claim.locked_until
            }
        );
        assert_eq!(record.operation_id, claim.operation_id);
        // Past its retention (here: none), the record is replaced by the
        // transaction's upsert, which this user may not run.
        let gone = idem_store_suite::request(
            "s",
            "gone",
            "{}",
            Duration::from_millis(1),
            Duration::from_millis(1),
        );
        assert!(matches!(
            main.claim(&gone).await.unwrap(),
            ClaimOutcome::Acquired(_)
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let refused = limited.claim(&gone).await;
        assert!(refused.is_err(), "{refused:?}");
        assert!(matches!(
            main.claim(&gone).await.unwrap(),
            ClaimOutcome::Acquired(_)
        ));
    };
    let result = tokio::spawn(outcome).await;
    sqlx::raw_sql(&format!("DROP USER '{user}'@'%'"))
        .execute(store.pool())
        .await
        .unwrap();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
}

/// A key longer than the table holds is refused, never cut short to fit:
/// cut short, its claim would be stored under another key than the one
/// its completion names.
#[tokio::test]
async fn an_overlong_key_is_refused_never_truncated() {
    use idem_core::{ClaimOutcome, Store, StoreError};
    let (store, _db) = fresh().await;
    let err = store.claim(&request(&"k".repeat(1021))).await.unwrap_err();
    assert!(matches!(err, StoreError::Backend(_)), "{err:?}");
    assert!(
        format!("{err:?}").contains("a key of 1021 bytes"),
        "{err:?}"
    );
    assert!(matches!(
        store.claim(&request(&"k".repeat(1020))).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
}

/// In sessions that do not commit each statement by themselves
/// (`autocommit = 0`), a new key is never claimed by an insert left
/// uncommitted: whatever the claim answers, a claim it reports acquired is
/// committed (another connection sees it), and a refused one left nothing.
#[tokio::test]
async fn a_session_without_autocommit_never_holds_an_uncommitted_claim() {
    use idem_core::{ClaimOutcome, Store};
    let (store, db) = fresh().await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET autocommit = 0").execute(conn).await?;
                Ok(())
            })
        })
        .connect(&db.url())
        .await
        .unwrap();
    let manual = MySqlStore::new(pool, TableName::default()).unwrap();
    for i in 0..4 {
        let key = format!("manual-{i}");
        let req = request(&key);
        let outcome = manual.claim(&req).await;
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records WHERE `key` = ?")
            .bind(&key)
            .fetch_one(store.pool())
            .await
            .unwrap();
        match outcome {
            Ok(ClaimOutcome::Acquired(_)) => assert_eq!(seen, 1, "acquired but not committed"),
            Ok(ClaimOutcome::Existing(r)) => panic!("a new key found {r:?}"),
            Err(_) => assert_eq!(seen, 0, "refused, yet a claim was left"),
        }
    }
}

/// An operator's `inspect` is a plain read: it answers while a transaction
/// holds the record's row (a claim's, a handler's completing it), where a
/// locking read waited for that transaction (InnoDB's lock wait: 50 s by
/// default) and needed the privilege to update the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reads_a_row_a_transaction_holds() {
    use idem_core::{ClaimOutcome, Store};
    use std::time::Duration;
    let (store, _db) = fresh().await;
    let ClaimOutcome::Acquired(_claim) = store.claim(&request("held")).await.unwrap() else {
        panic!("a new key is claimed")
    };
    let table = store.table().table().to_owned();
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM `{table}` WHERE `key` = 'held' FOR UPDATE"
    ))
    .execute(&mut *holder)
    .await
    .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(10), store.inspect("s", "held"))
        .await
        .expect("inspect answered while the row is held")
        .unwrap()
        .expect("the record");
    assert_eq!(seen.record.key, "held");
    holder.rollback().await.unwrap();
}
