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
/// (`autocommit = 0`: a pool's hook, or the server's default), a claim is
/// refused with the reason, and leaves nothing. There the store's own
/// one-statement writes would never commit: a completion the layer stores
/// after the handler would stay open on its connection, and once the lease
/// ran out a retry would run the request again. (Before, the claim went
/// through its transaction and was acquired; its completion was lost.)
#[tokio::test]
async fn a_session_without_autocommit_is_refused_with_the_reason() {
    use idem_core::{Store, StoreError};
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
        let refused = manual.claim(&request(&key)).await;
        let Err(StoreError::Backend(reason)) = &refused else {
            panic!("a session without autocommit: {refused:?}");
        };
        assert!(reason.to_string().contains("autocommit"), "{reason}");
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records WHERE `key` = ?")
            .bind(&key)
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(seen, 0, "refused, yet a claim was left");
    }
}

/// A transaction of the test's own holding the row of `key` (scope `s`):
/// a handler that completed the record and has not committed.
async fn hold_row(store: &MySqlStore, key: &str) -> sqlx::Transaction<'static, sqlx::MySql> {
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM `{}` WHERE scope = 's' AND `key` = ? FOR UPDATE",
        store.table().table()
    ))
    .bind(key)
    .execute(&mut *holder)
    .await
    .unwrap();
    holder
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
    let holder = hold_row(&store, "held").await;
    let seen = tokio::time::timeout(Duration::from_secs(10), store.inspect("s", "held"))
        .await
        .expect("inspect answered while the row is held")
        .unwrap()
        .expect("the record");
    assert_eq!(seen.record.key, "held");
    holder.rollback().await.unwrap();
}

/// A claim on a pool of one connection (the one the claim used is the one
/// read after it), its short lease run out, while another transaction
/// holds its row: a handler past its lease that completed the record and
/// has not committed.
struct Held {
    store: MySqlStore,
    pool: sqlx::MySqlPool,
    single: MySqlStore,
    short: idem_core::ClaimRequest,
    holder: sqlx::Transaction<'static, sqlx::MySql>,
    _db: TestDatabase,
}

async fn held_after_its_lease() -> Held {
    use idem_core::{ClaimOutcome, Store};
    use std::time::Duration;
    let (store, db) = fresh().await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&db.url())
        .await
        .unwrap();
    let single = MySqlStore::new(pool.clone(), TableName::default()).unwrap();
    let short = idem_store_suite::request(
        "s",
        "k",
        "{}",
        Duration::from_millis(200),
        Duration::from_secs(3600),
    );
    let ClaimOutcome::Acquired(_claim) = single.claim(&short).await.unwrap() else {
        panic!("a new key is claimed")
    };
    let holder = hold_row(&store, "k").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    Held {
        store,
        pool,
        single,
        short,
        holder,
        _db: db,
    }
}

/// A claim meets a record's row held by another transaction, still open (a
/// handler past its lease that completed the record in it, and has not
/// committed): the claim gives up on the lock after 2 s, once (`503` for
/// now), instead of waiting InnoDB's 50 s, again for each of its retries,
/// with its connection. The session's own setting is left as it was for
/// the pool's next user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_on_a_held_row_a_bounded_time() {
    use idem_core::{ClaimOutcome, Store, StoreError};
    use std::time::{Duration, Instant};
    // Every field bound (`..` would drop the store and the database at
    // once).
    let Held {
        store: _store,
        pool,
        single,
        short,
        holder,
        _db,
    } = held_after_its_lease().await;
    let session_wait = async || -> u64 {
        sqlx::query_scalar("SELECT @@SESSION.innodb_lock_wait_timeout")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let global: u64 = sqlx::query_scalar("SELECT @@GLOBAL.innodb_lock_wait_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    let inserts = async || -> u64 {
        let (_, n): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Com_insert'")
            .fetch_one(&pool)
            .await
            .unwrap();
        n.parse().unwrap()
    };
    let before = inserts().await;
    let started = Instant::now();
    let retry = tokio::time::timeout(Duration::from_secs(30), single.claim(&short))
        .await
        .expect("the claim gave up on the lock within 30 s");
    let waited = started.elapsed();
    assert_eq!(
        inserts().await - before,
        1,
        "one upsert: a lock wait timed out is not waited again"
    );
    assert!(
        matches!(retry, Err(StoreError::Unavailable(_))),
        "{retry:?}"
    );
    assert!(
        waited >= Duration::from_millis(1900),
        "it waited for the lock first: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(20),
        "it gave up after one bounded wait: {waited:?}"
    );
    assert_eq!(
        session_wait().await,
        global,
        "the session's lock wait is as it was"
    );
    holder.rollback().await.unwrap();
    // Once the row is free, the retry takes the lease over.
    let again = single.claim(&short).await.unwrap();
    assert!(
        matches!(&again, ClaimOutcome::Acquired(c) if c.takeover),
        "{again:?}"
    );
}

/// A record past its retention whose row a transaction holds: the claim
/// goes straight to its transaction, whose lock wait is bounded, rather
/// than first trying a new key's insert, which waited InnoDB's whole lock
/// wait (50 s) on the row before failing on the primary key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_record_past_its_retention_is_waited_for_a_bounded_time() {
    use idem_core::{ClaimOutcome, Store, StoreError};
    use std::time::{Duration, Instant};
    let (store, _db) = fresh().await;
    let brief = idem_store_suite::request(
        "s",
        "old",
        "{}",
        Duration::from_millis(1),
        Duration::from_millis(1),
    );
    let ClaimOutcome::Acquired(_claim) = store.claim(&brief).await.unwrap() else {
        panic!("a new key is claimed")
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let holder = hold_row(&store, "old").await;
    let started = Instant::now();
    let retry = tokio::time::timeout(Duration::from_secs(40), store.claim(&request("old")))
        .await
        .expect("the claim gave up on the lock within 40 s");
    assert!(
        matches!(retry, Err(StoreError::Unavailable(_))),
        "{retry:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "one bounded wait: {:?}",
        started.elapsed()
    );
    holder.rollback().await.unwrap();
    assert!(matches!(
        store.claim(&request("old")).await.unwrap(),
        ClaimOutcome::Acquired(c) if !c.takeover
    ));
}

/// A claim whose caller stops waiting while its transaction waits for a
/// row, which is then let go: its connection is closed, never handed on
/// inside the claim's transaction (its upsert ran once the row was free)
/// or with the claim's lock wait still set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_dropped_while_it_waits_hands_on_no_session_state() {
    use idem_core::Store;
    use std::time::Duration;
    let Held {
        store,
        pool,
        single,
        short,
        holder,
        _db,
    } = held_after_its_lease().await;
    let table = store.table().table().to_owned();
    let dropped = tokio::time::timeout(Duration::from_millis(300), single.claim(&short)).await;
    assert!(dropped.is_err(), "{dropped:?}");
    holder.rollback().await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let (session, global, open): (u64, u64, i64) = sqlx::query_as(
        "SELECT @@SESSION.innodb_lock_wait_timeout, @@GLOBAL.innodb_lock_wait_timeout,
                (SELECT COUNT(*) FROM information_schema.innodb_trx
                  WHERE trx_mysql_thread_id = CONNECTION_ID())",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(open, 0, "the pool's connection is inside a transaction");
    assert_eq!(session, global, "the session's lock wait is as it was");
    drop(conn);
    // The row is free: nothing holds it in a transaction left open.
    let mut other = store.pool().begin().await.unwrap();
    let free = tokio::time::timeout(
        Duration::from_secs(10),
        sqlx::query(&format!(
            "SELECT 1 FROM `{table}` WHERE `key` = 'k' FOR UPDATE"
        ))
        .execute(&mut *other),
    )
    .await;
    assert!(matches!(free, Ok(Ok(_))), "{free:?}");
    other.rollback().await.unwrap();
}

/// A record past its retention is replaced by the claim's transaction
/// straight away: the first look says so, and no new key's insert is
/// tried first (one statement that could only fail on the primary key,
/// after waiting for any transaction holding the row).
#[tokio::test]
async fn a_record_past_its_retention_is_not_first_inserted_over() {
    use idem_core::{ClaimOutcome, Store};
    use std::time::Duration;
    let (_store, db) = fresh().await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&db.url())
        .await
        .unwrap();
    let single = MySqlStore::new(pool.clone(), TableName::default()).unwrap();
    let inserts = async || -> u64 {
        let (_, n): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Com_insert'")
            .fetch_one(&pool)
            .await
            .unwrap();
        n.parse().unwrap()
    };
    let brief = idem_store_suite::request(
        "s",
        "old",
        "{}",
        Duration::from_millis(1),
        Duration::from_millis(1),
    );
    let before = inserts().await;
    assert!(matches!(
        single.claim(&brief).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    assert_eq!(inserts().await - before, 1, "a new key: one insert");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let before = inserts().await;
    assert!(matches!(
        single.claim(&request("old")).await.unwrap(),
        ClaimOutcome::Acquired(c) if !c.takeover
    ));
    assert_eq!(
        inserts().await - before,
        1,
        "past its retention: the upsert alone"
    );
}
