//! The `idem` binary against real SQLite files and PostgreSQL schemas.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{ClaimOutcome, Store, StoredResponse};
use idem_store_suite::request;
use idem_test_support::postgres::TestSchema;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .output()
        .expect("run idem")
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "idem failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Fills a store with one completed record, one held, and one past its
/// retention.
async fn fill(store: Arc<dyn Store>) -> String {
    let long = Duration::from_secs(600);
    let ClaimOutcome::Acquired(done) = store
        .claim(&request("c1", "done", "{}", long, long * 10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![("location".into(), b"/payments/1".to_vec())],
        body: Bytes::from_static(b"{\"secret\":\"card-4242\"}"),
    };
    store.complete(&done, &response).await.unwrap();
    let ClaimOutcome::Acquired(_) = store
        .claim(&request("c1", "held", "{}", long, long * 10))
        .await
        .unwrap()
    else {
        panic!()
    };
    let short = request(
        "c1",
        "old",
        "{}",
        Duration::from_millis(100),
        Duration::from_millis(300),
    );
    let ClaimOutcome::Acquired(old) = store.claim(&short).await.unwrap() else {
        panic!()
    };
    store.complete(&old, &response).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    done.operation_id.to_string()
}

async fn exercise(url: &str, store: Arc<dyn Store>) {
    let operation_id = fill(store).await;

    let stats = stdout(&idem(&["stats", "--database-url", url]));
    assert!(
        stats.contains("in progress:    1 (0 with an expired lease)"),
        "{stats}"
    );
    assert!(stats.contains("completed:      2"), "{stats}");
    assert!(stats.contains("past retention: 1"), "{stats}");
    assert!(stats.contains("oldest record:  20"), "{stats}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&idem(&["stats", "--json", "--database-url", url]))).unwrap();
    assert_eq!(json["completed"], 2);

    let seen = stdout(&idem(&[
        "inspect",
        "--database-url",
        url,
        "--scope",
        "c1",
        "--key",
        "done",
    ]));
    assert!(seen.contains("state:        completed"), "{seen}");
    assert!(seen.contains(&operation_id), "{seen}");
    assert!(
        seen.contains("status:       201 (1 header, 22 byte body)"),
        "{seen}"
    );
    assert!(seen.contains("age "), "{seen}");
    assert!(
        !seen.contains("card-4242"),
        "the body is never shown unless asked: {seen}"
    );
    let shown = stdout(&idem(&[
        "inspect",
        "--database-url",
        url,
        "--scope",
        "c1",
        "--key",
        "done",
        "--show-body",
    ]));
    assert!(shown.contains("card-4242"), "{shown}");
    assert!(shown.contains("location: /payments/1"), "{shown}");

    let held = stdout(&idem(&[
        "inspect",
        "--database-url",
        url,
        "--scope",
        "c1",
        "--key",
        "held",
    ]));
    assert!(held.contains("state:        in progress"), "{held}");
    assert!(held.contains("(held, ends in"), "{held}");
    assert!(
        held.lines()
            .any(|l| l.starts_with("token:") && l.trim_end().len() > 14),
        "{held}"
    );
    let held_json: serde_json::Value = serde_json::from_str(&stdout(&idem(&[
        "inspect",
        "--json",
        "--database-url",
        url,
        "--scope",
        "c1",
        "--key",
        "held",
    ])))
    .unwrap();
    assert_eq!(held_json["state"], "in_progress");
    assert!(held_json["token"].as_i64().is_some());
    assert_eq!(held_json["shortest_retention_ms"], 6_000_000);

    let old = stdout(&idem(&[
        "inspect",
        "--database-url",
        url,
        "--scope",
        "c1",
        "--key",
        "old",
    ]));
    assert!(old.contains("past retention"), "{old}");

    let missing = idem(&[
        "inspect",
        "--database-url",
        url,
        "--scope",
        "c1",
        "--key",
        "nope",
    ]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no record"));

    assert_eq!(
        stdout(&idem(&["sweep", "--database-url", url, "--batch", "1"])).trim(),
        "swept 1 expired record"
    );
    assert_eq!(
        stdout(&idem(&["sweep", "--database-url", url])).trim(),
        "swept 0 expired records"
    );
    let after = stdout(&idem(&["stats", "--database-url", url]));
    assert!(after.contains("past retention: 0"), "{after}");
    assert!(after.contains("completed:      1"), "{after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_sqlite_database() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ops.db");
    let url = format!("sqlite:{}", path.display());
    // reading a database that is not there does not create it
    let absent = idem(&["stats", "--database-url", &url]);
    assert_eq!(absent.status.code(), Some(2));
    assert!(!path.exists());
    assert!(stdout(&idem(&["migrate", "--database-url", &url])).contains("migrated"));
    assert!(stdout(&idem(&["migrate", "--database-url", &url])).contains("migrated"));
    let store = idem_sqlite::SqliteStore::connect(&url).await.unwrap();
    exercise(&url, Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operates_a_postgres_database() {
    let schema = TestSchema::create("idem_cli").await;
    let url = schema.url();
    let before = idem(&["stats", "--database-url", &url]);
    assert_eq!(before.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&before.stderr).contains("idem migrate"),
        "a hint to migrate"
    );
    assert!(stdout(&idem(&["migrate", "--database-url", &url])).contains("migrated"));
    let store = idem_postgres::PostgresStore::connect(&url).await.unwrap();
    exercise(&url, Arc::new(store)).await;
}

/// Every verb on MySQL / MariaDB, in a database of the test's own; the
/// outbox's counts and dead letters there; `--schema` names a database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    let db = idem_test_support::mysql::TestDatabase::create("idem_cli").await;
    let url = db.url();
    let missing = idem(&["stats", "--database-url", &url]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("run `idem migrate` first"),
        "a missing table is named as one: {missing:?}"
    );
    stdout(&idem(&["migrate", "--database-url", &url]));
    let store = idem_mysql::MySqlStore::connect(&url).await.unwrap();
    exercise(&url, Arc::new(store.clone())).await;
    idem_outbox::outbox::migrate(store.pool()).await.unwrap();
    let out = stdout(&idem(&["outbox", "--database-url", &url]));
    assert!(out.contains("pending:        0"), "{out}");

    let other = idem_test_support::mysql::TestDatabase::create("idem_cli_named").await;
    let named = [
        "--database-url",
        url.as_str(),
        "--schema",
        other.name(),
        "--table",
        "billing_keys",
    ];
    let mut migrate = vec!["migrate"];
    migrate.extend(named);
    stdout(&idem(&migrate));
    let mut stats = vec!["stats"];
    stats.extend(named);
    assert!(stdout(&idem(&stats)).contains("completed:      0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_schema_and_table_flags_name_the_table() {
    let schema = TestSchema::create("idem_cli_named").await;
    let base = idem_test_support::postgres::database_url();
    let args = [
        "--database-url",
        &base,
        "--schema",
        schema.name(),
        "--table",
        "billing_keys",
    ];
    let mut migrate = vec!["migrate"];
    migrate.extend(args);
    stdout(&idem(&migrate));
    let table = idem_postgres::TableName::new(Some(schema.name()), "billing_keys").unwrap();
    let store = idem_postgres::PostgresStore::connect_with(&base, table)
        .await
        .unwrap();
    fill(Arc::new(store)).await;
    let mut stats = vec!["stats"];
    stats.extend(args);
    assert!(stdout(&idem(&stats)).contains("completed:      2"));
}

#[test]
fn bad_input_is_a_clear_error() {
    let o = idem(&["stats", "--database-url", "oracle://x"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unsupported database URL"));
    let o = idem(&["stats", "--database-url", "sqlite:x.db", "--schema", "s"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("PostgreSQL and MySQL only"));
    let o = idem(&[
        "stats",
        "--database-url",
        "postgres://u:hunter2@127.0.0.1:1/x",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("hunter2"), "passwords are not printed: {err}");
    let o = idem(&[
        "stats",
        "--database-url",
        "postgres://x",
        "--table",
        "bad name",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a valid identifier"));
}

/// Every secret of the URLs below, as written and decoded.
const SECRETS: [&str; 5] = [
    "Userinfo-S3cret",
    "Encoded%40S3cret",
    "Encoded@S3cret",
    "Query-S3cret",
    "Ssl-S3cret",
];

fn assert_no_secret(o: &Output) {
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    for secret in SECRETS {
        assert!(!out.contains(secret), "{secret} was printed: {out}");
    }
    assert!(
        !out.contains("S3cret"),
        "part of a secret was printed: {out}"
    );
}

#[test]
fn database_url_passwords_never_reach_the_output() {
    // Nothing listens on port 1: the connection fails and the URL is reported.
    for url in [
        "postgres://ops:Userinfo-S3cret@127.0.0.1:1/db?sslmode=disable&password=Query-S3cret&sslpassword=Ssl-S3cret",
        "postgresql://ops:Encoded%40S3cret@127.0.0.1:1/db?PassWord=Query-S3cret",
    ] {
        let o = idem(&["stats", "--database-url", url]);
        assert_eq!(o.status.code(), Some(2), "{o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("cannot connect to postgres"), "{err}");
        assert!(err.contains("://ops:***@127.0.0.1:1/db?"), "{err}");
        assert!(err.contains("=***"), "{err}");
        assert_no_secret(&o);
    }
    // the same through DATABASE_URL
    let o = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["migrate"])
        .env(
            "DATABASE_URL",
            "postgres://ops:Userinfo-S3cret@127.0.0.1:1/db?sslpassword=Ssl-S3cret",
        )
        .env_remove("REDIS_URL")
        .output()
        .expect("run idem");
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert_no_secret(&o);
    // MySQL's URL likewise
    let o = idem(&[
        "stats",
        "--database-url",
        "mysql://ops:Userinfo-S3cret@127.0.0.1:1/x?password=Query-S3cret",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot connect to mysql://ops:***@"), "{err}");
    assert_no_secret(&o);
    // an unsupported scheme is reported without its secrets too
    let o = idem(&[
        "stats",
        "--database-url",
        "oracle://ops:Userinfo-S3cret@db/x?password=Query-S3cret",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("unsupported database URL"), "{err}");
    assert_no_secret(&o);
}

#[test]
fn redis_url_passwords_never_reach_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("redacted.db").display());
    stdout(&idem(&["migrate", "--database-url", &url]));
    let o = idem(&[
        "stats",
        "--database-url",
        &url,
        "--redis-url",
        "redis://:Userinfo-S3cret@127.0.0.1:1/0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot connect to Redis at redis://:***@127.0.0.1:1/0"),
        "{err}"
    );
    assert_no_secret(&o);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shows_the_outbox_and_its_dead_letters() {
    let schema = TestSchema::create("idem_cli_outbox").await;
    let url = schema.url();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    idem_outbox::outbox::migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    for (id, dest) in [("ok-1", "orders"), ("bad-1", "nowhere")] {
        let m = idem_outbox::OutgoingMessage {
            message_id: id.into(),
            destination: dest.into(),
            ordering_key: None,
            payload: Bytes::from_static(b"{}"),
            headers: vec![],
        };
        idem_outbox::enqueue(&mut tx, &m).await.unwrap();
    }
    tx.commit().await.unwrap();
    let transport = Arc::new(idem_outbox::transport::InProcess::new());
    let mut orders = transport.subscribe("orders");
    tokio::spawn(async move {
        while let Some(d) = orders.recv().await {
            d.ack();
        }
    });
    let relay = idem_outbox::Relay::new(
        &pool,
        transport,
        idem_outbox::RelayConfig {
            max_attempts: 1,
            ..Default::default()
        },
    );
    relay.round().await.unwrap();
    let out = stdout(&idem(&["outbox", "--database-url", &url]));
    assert!(out.contains("pending:        0"), "{out}");
    assert!(out.contains("sent:           1"), "{out}");
    assert!(out.contains("dead-lettered:  1"), "{out}");
    assert!(
        out.contains(
            "dead: bad-1 -> nowhere after 1 attempt(s): broker unreachable: no consumer subscribed to nowhere"
        ),
        "{out}"
    );
}

fn idem_with_input(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_a_stuck_claim_after_confirmation_and_refuses_a_completed_record() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("release.db").display());
    let store = Arc::new(idem_sqlite::SqliteStore::connect(&url).await.unwrap());
    fill(store.clone()).await;
    // The holder's lease still runs: refused without --force, nothing asked.
    let live = idem(&[
        "release",
        "--database-url",
        &url,
        "--scope",
        "c1",
        "--key",
        "held",
        "--yes",
    ]);
    assert_eq!(live.status.code(), Some(1));
    let said = String::from_utf8_lossy(&live.stderr);
    assert!(
        said.contains("lease runs until") && said.contains("--force"),
        "{said}"
    );
    let args = [
        "release",
        "--database-url",
        &url,
        "--scope",
        "c1",
        "--key",
        "held",
        "--force",
    ];

    let declined = idem_with_input(&args, "no\n");
    assert_eq!(declined.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&declined.stdout).contains("not released"));
    let still: ClaimOutcome = store
        .claim(&request(
            "c1",
            "held",
            "{}",
            Duration::from_secs(60),
            Duration::from_secs(600),
        ))
        .await
        .unwrap();
    assert!(
        matches!(still, ClaimOutcome::Existing(_)),
        "still held after declining"
    );

    let confirmed = idem_with_input(&args, "yes\n");
    assert!(
        confirmed.status.success(),
        "{}",
        String::from_utf8_lossy(&confirmed.stderr)
    );
    assert!(String::from_utf8_lossy(&confirmed.stdout).contains("released: the next retry"));
    let retry = store
        .claim(&request(
            "c1",
            "held",
            "{}",
            Duration::from_secs(60),
            Duration::from_secs(600),
        ))
        .await
        .unwrap();
    assert!(
        matches!(retry, ClaimOutcome::Acquired(ref c) if c.takeover),
        "{retry:?}"
    );

    let refused = idem(&[
        "release",
        "--database-url",
        &url,
        "--scope",
        "c1",
        "--key",
        "done",
        "--yes",
    ]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("refused: the record is completed"));
    let missing = idem(&[
        "release",
        "--database-url",
        &url,
        "--scope",
        "c1",
        "--key",
        "nope",
        "--yes",
    ]);
    assert_eq!(missing.status.code(), Some(1));
}

/// Records in a SQLite file of the test's own with Redis in front, under a
/// key prefix of its own.
struct Tiered {
    dir: tempfile::TempDir,
    url: String,
    prefix: String,
    redis: idem_redis::RedisStore,
    tiered: Arc<dyn Store>,
}

impl Tiered {
    /// A claim of `key` under scope `c1`: a lease of ten minutes, kept for
    /// ten times that.
    fn request(key: &str) -> idem_core::ClaimRequest {
        let lease = Duration::from_secs(600);
        request("c1", key, "{}", lease, lease * 10)
    }

    async fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("tier.db").display());
        let prefix = format!("{name}-{}", uuid::Uuid::new_v4().simple());
        let sql = idem_sqlite::SqliteStore::connect(&url).await.unwrap();
        let redis = idem_redis::RedisStore::connect(
            idem_redis::RedisConfig::new("redis://127.0.0.1:6379").prefix(&prefix),
        )
        .await
        .unwrap();
        let tiered: Arc<dyn Store> = Arc::new(idem_redis::TieredStore::new(sql, redis.clone()));
        Self {
            dir,
            url,
            prefix,
            redis,
            tiered,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_stats_show_redis_in_tiered_mode() {
    let Tiered {
        dir: _dir,
        url,
        prefix,
        redis,
        tiered,
    } = Tiered::new("cli-tier").await;
    fill(tiered.clone()).await;
    // a replay reads the completed record through and caches it in Redis
    let again = tiered.claim(&Tiered::request("done")).await.unwrap();
    assert!(matches!(again, ClaimOutcome::Existing(_)));
    let redis_args = [
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--redis-prefix",
        prefix.as_str(),
    ];
    let mut inspect = vec![
        "inspect",
        "--database-url",
        url.as_str(),
        "--scope",
        "c1",
        "--key",
        "done",
    ];
    inspect.extend(redis_args);
    let out = stdout(&idem(&inspect));
    assert!(
        out.contains("redis:        completed record cached for replay (status 201"),
        "{out}"
    );
    let mut stats = vec!["stats", "--database-url", url.as_str()];
    stats.extend(redis_args);
    let out = stdout(&idem(&stats));
    assert!(out.contains("redis keys:"), "{out}");
    redis.clear().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_in_tiered_mode_clears_the_redis_in_flight_marker_too() {
    let Tiered {
        dir: _dir,
        url,
        prefix,
        redis,
        tiered,
    } = Tiered::new("cli-release").await;
    let req = Tiered::request("stuck");
    let ClaimOutcome::Acquired(first) = tiered.claim(&req).await.unwrap() else {
        panic!("a new key is claimed")
    };
    // The holder died: duplicates are told "in flight" by Redis.
    assert!(matches!(
        tiered.claim(&req).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    let out = idem(&[
        "release",
        "--database-url",
        url.as_str(),
        "--scope",
        "c1",
        "--key",
        "stuck",
        "--yes",
        "--force",
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--redis-prefix",
        prefix.as_str(),
    ]);
    assert!(out.status.success(), "{out:?}");
    // The retry takes the claim over at once, not after the lease.
    let ClaimOutcome::Acquired(retry) = tiered.claim(&req).await.unwrap() else {
        panic!("released in SQL and in Redis")
    };
    assert!(retry.takeover);
    assert_eq!(retry.operation_id, first.operation_id);

    // Forced without --redis-url: the database's claim goes, Redis's marker
    // stays (still 409 until the lease ends), and the note says so.
    let other = Tiered::request("stuck-2");
    assert!(matches!(
        tiered.claim(&other).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    let out = idem(&[
        "release",
        "--database-url",
        url.as_str(),
        "--scope",
        "c1",
        "--key",
        "stuck-2",
        "--yes",
        "--force",
    ]);
    assert!(out.status.success(), "{out:?}");
    let note = String::from_utf8_lossy(&out.stderr);
    assert!(
        note.contains("in-flight marker still answers 409") && note.contains("--redis-url"),
        "{note}"
    );
    assert!(matches!(
        tiered.claim(&other).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    redis.clear().await.unwrap();
}

/// In tiered mode, a release whose database part succeeded but whose Redis
/// marker could not be deleted (here a Redis user without `DEL`) says that
/// it released, what is left, and exits 2; run again once Redis answers,
/// it finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiered_release_whose_redis_marker_stays_says_so() {
    let Tiered {
        dir: _dir,
        url,
        prefix,
        redis,
        tiered,
    } = Tiered::new("cli-half").await;
    let req = Tiered::request("half");
    assert!(matches!(
        tiered.claim(&req).await.unwrap(),
        ClaimOutcome::Acquired(_)
    ));
    let user = format!("idem-nodel-{}", uuid::Uuid::new_v4().simple());
    let admin = redis::Client::open("redis://127.0.0.1:6379").unwrap();
    let mut admin = admin.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER", &user, "on", ">pw", "~*", "&*", "+@all", "-del", "-unlink",
            ][..],
        )
        .query_async(&mut admin)
        .await
        .unwrap();
    let nodel = format!("redis://{user}:pw@127.0.0.1:6379");
    let release = |redis_url: &str| {
        idem(&[
            "release",
            "--database-url",
            url.as_str(),
            "--scope",
            "c1",
            "--key",
            "half",
            "--yes",
            "--force",
            "--redis-url",
            redis_url,
            "--redis-prefix",
            prefix.as_str(),
        ])
    };
    let out = release(&nodel);
    let _: () = redis::cmd("ACL")
        .arg(&["DELUSER", &user][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("released:"),
        "{out:?}"
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("in-flight marker could not be deleted")
            && said.contains("run this release again"),
        "{said}"
    );
    // Redis still answers 409 for the key.
    assert!(matches!(
        tiered.claim(&req).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    // Again, with a Redis that answers: done.
    let out = release("redis://127.0.0.1:6379");
    assert!(out.status.success(), "{out:?}");
    let ClaimOutcome::Acquired(retry) = tiered.claim(&req).await.unwrap() else {
        panic!("released in SQL and in Redis")
    };
    assert!(retry.takeover);
    redis.clear().await.unwrap();
}

/// A schema of the test's own (named from `prefix`) whose records table
/// holds a claim of key `key` in scope `c1` under `lease`; and its URL.
async fn claimed_on_postgres(prefix: &str, key: &str, lease: Duration) -> (TestSchema, String) {
    let schema = TestSchema::create(prefix).await;
    let url = schema.url();
    let store = idem_postgres::PostgresStore::connect(&url).await.unwrap();
    let claimed = store
        .claim(&request("c1", key, "{}", lease, Duration::from_secs(600)))
        .await
        .unwrap();
    assert!(matches!(claimed, ClaimOutcome::Acquired(_)));
    (schema, url)
}

/// `url` with its user replaced by `user` (no password: trust auth).
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{host}")
}

/// An operator who may only read the records still inspects one in flight:
/// whether a transaction holds it (a probe that locks the row, so takes
/// UPDATE privilege on PostgreSQL) is reported unknown, rather than the
/// whole command failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_by_a_reader_shows_the_record_and_an_unknown_hold() {
    let (schema, url) =
        claimed_on_postgres("idem_cli_reader", "read-only", Duration::from_secs(600)).await;
    let role = format!("idem_reader_{}", uuid::Uuid::new_v4().simple());
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let _dropped = RoleGuard {
        role: role.clone(),
        url: url.clone(),
    };
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA \"{}\" TO {role}", schema.name()),
        format!(
            "GRANT SELECT ON \"{}\".idem_records TO {role}",
            schema.name()
        ),
    ] {
        sqlx::query(&sql).execute(&pool).await.unwrap();
    }
    let reader = as_user(&url, &role);
    let args = [
        "--database-url",
        &reader,
        "--scope",
        "c1",
        "--key",
        "read-only",
    ];
    let out = idem(&[&["inspect"], &args[..]].concat());
    let shown = stdout(&out);
    assert!(
        shown.contains("in_progress") || shown.contains("in progress"),
        "{shown}"
    );
    assert!(
        shown.contains("held:") && shown.contains("unknown"),
        "{shown}"
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("could not tell whether an open transaction holds"),
        "{said}"
    );
    let json = stdout(&idem(&[&["inspect", "--json"], &args[..]].concat()));
    assert!(json.contains("\"held_by_transaction\":null"), "{json}");
    pool.close().await;
}

/// Drops a test's role (roles outlive schemas), pass or fail.
struct RoleGuard {
    role: String,
    url: String,
}

impl Drop for RoleGuard {
    fn drop(&mut self) {
        let (role, url) = (self.role.clone(), self.url.clone());
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let pool = sqlx::PgPool::connect(&url).await.unwrap();
                for sql in [
                    format!("DROP OWNED BY {role}"),
                    format!("DROP ROLE IF EXISTS {role}"),
                ] {
                    // DROP OWNED fails for a role never made; the DROP ROLE after it is what counts.
                    let _ = sqlx::query(&sql).execute(&pool).await;
                }
                pool.close().await;
            });
        })
        .join();
        if dropped.is_err() {
            eprintln!("could not drop test role {}", self.role);
        }
    }
}

/// A claim held by an open transaction (PostgreSQL's claim-in-transaction
/// mode): `inspect` says so whatever its lease says, and `release` refuses
/// it without `--force`; once the transaction ends, the lease rules again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_by_a_transaction_is_shown_held_and_not_released() {
    let (_schema, url) =
        claimed_on_postgres("idem_cli_held", "in-tx", Duration::from_millis(10)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    // A holder's transaction keeps the row locked, its lease long past.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idem_records WHERE scope = 'c1' AND key = 'in-tx' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let args = ["--database-url", &url, "--scope", "c1", "--key", "in-tx"];
    let shown = stdout(&idem(&[&["inspect"], &args[..]].concat()));
    assert!(shown.contains("held by an open transaction"), "{shown}");
    assert!(!shown.contains("the next retry takes over"), "{shown}");
    let json = stdout(&idem(&[&["inspect", "--json"], &args[..]].concat()));
    assert!(json.contains("\"held_by_transaction\":true"), "{json}");
    let refused = idem(&[&["release", "--yes"], &args[..]].concat());
    assert_eq!(refused.status.code(), Some(1));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("refused: an open transaction holds this record"),
        "{said}"
    );

    holder.rollback().await.unwrap();
    let shown = stdout(&idem(&[&["inspect"], &args[..]].concat()));
    assert!(shown.contains("the next retry takes over"), "{shown}");
    let released = idem(&[&["release", "--yes"], &args[..]].concat());
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stderr)
    );
    pool.close().await;
}

/// `--schema` and `--outbox-table` name the outbox read: an outbox in a
/// table of its own is counted, and the default one is not confused
/// with it.
#[tokio::test]
async fn the_outbox_read_is_the_one_named() {
    let schema = TestSchema::create("idem_cli_outbox_named").await;
    let url = schema.url();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let table = idem_outbox::OutboxTable::new(Some(schema.name()), "billing_outbox").unwrap();
    table.migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let m = idem_outbox::OutgoingMessage::new("b-1", "billing", "{}");
    table.enqueue(&mut *tx, &m).await.unwrap();
    tx.commit().await.unwrap();
    let out = stdout(&idem(&[
        "outbox",
        "--database-url",
        &url,
        "--schema",
        schema.name(),
        "--outbox-table",
        "billing_outbox",
    ]));
    assert!(out.contains("pending:        1"), "{out}");
    // The default table is not there: said, not read from elsewhere.
    let default = idem(&["outbox", "--database-url", &url, "--schema", schema.name()]);
    assert_eq!(default.status.code(), Some(2));
    let said = String::from_utf8_lossy(&default.stderr);
    assert!(said.contains("idem_outbox"), "{said}");
    // The limit is bounded.
    let limit = idem(&["outbox", "--database-url", &url, "--limit", "-1"]);
    assert_eq!(limit.status.code(), Some(2));
}

/// `--help` names the environment variables it reads, never their values:
/// a job that prints it with `DATABASE_URL` or `REDIS_URL` set does not
/// put the passwords in its log. And a store that cannot be reached is
/// said without them, in `idem once` too.
#[test]
fn help_and_errors_never_show_the_urls_passwords() {
    for verb in [
        &["once", "--help"][..],
        &["proxy", "--help"],
        &["inspect", "--help"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(verb)
            .env("DATABASE_URL", "postgres://app:hunter22@db.invalid/app")
            .env("REDIS_URL", "redis://:hunter33@cache.invalid:6379")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains("DATABASE_URL"), "{verb:?}: {said}");
        assert!(
            !said.contains("hunter22") && !said.contains("hunter33"),
            "{verb:?}: {said}"
        );
    }
    for (url, exit) in [
        // redis-rs reads a socket's password from `?pass=`.
        ("redis+unix:///nowhere/redis.sock?pass=hunter44", 64),
        ("redis://:hunter44@127.0.0.1:1", 69),
        ("host=db user=app password=hunter44", 64),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["once", "--scope", "s", "--key", "k", "--", "true"])
            .env("DATABASE_URL", url)
            .env_remove("REDIS_URL")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(exit), "{url}: {said}");
        assert!(!said.contains("hunter44"), "{url}: {said}");
    }
}
