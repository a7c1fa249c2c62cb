//! `idem proxy` in front of an upstream written in Python's standard
//! library (`tests/proxy_upstream.py`), which counts deliveries and effects
//! per operation id and can be told to be slow, fail or crash; on SQLite,
//! PostgreSQL, MySQL, Redis in front of PostgreSQL (tiered), and Redis
//! alone. Racing duplicates reach the upstream once; replays are
//! byte-identical; a reused key is refused; a `5xx` releases and the retry
//! carries the same operation id; an unknown outcome holds the key for its
//! lease; a proxy killed with `kill -9` is taken over; two proxies on one
//! PostgreSQL behave as one; SIGTERM drains.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_test_support::mysql::TestDatabase;
use idem_test_support::postgres::TestSchema;
use idem_test_support::redis::{redis_url, TestPrefix};
use serde_json::Value;

/// Where a proxy keeps its records, and what to drop afterwards.
struct Records {
    args: Vec<String>,
    _dir: Option<tempfile::TempDir>,
    _schema: Option<TestSchema>,
    _db: Option<TestDatabase>,
    _prefix: Option<TestPrefix>,
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    Sqlite,
    /// SQLite with `--sqlite-synchronous normal`.
    SqliteNormal,
    Postgres,
    MySql,
    Tiered,
    Redis,
}

async fn records(mode: Mode) -> Records {
    let mut r = Records {
        args: Vec::new(),
        _dir: None,
        _schema: None,
        _db: None,
        _prefix: None,
    };
    let url = match mode {
        Mode::Sqlite | Mode::SqliteNormal => {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite:{}", dir.path().join("proxy.db").display());
            r._dir = Some(dir);
            url
        }
        Mode::Postgres | Mode::Tiered => {
            let schema = TestSchema::create("proxy").await;
            let url = schema.url();
            r._schema = Some(schema);
            url
        }
        Mode::MySql => {
            let db = TestDatabase::create("proxy").await;
            let url = db.url();
            r._db = Some(db);
            url
        }
        Mode::Redis => redis_url(),
    };
    r.args.extend(["--database-url".to_owned(), url]);
    if matches!(mode, Mode::SqliteNormal) {
        r.args
            .extend(["--sqlite-synchronous".to_owned(), "normal".to_owned()]);
    }
    if matches!(mode, Mode::Tiered | Mode::Redis) {
        let prefix = TestPrefix::new("proxy");
        if matches!(mode, Mode::Tiered) {
            r.args.extend(["--redis-url".to_owned(), redis_url()]);
        }
        r.args
            .extend(["--redis-prefix".to_owned(), prefix.name().to_owned()]);
        r._prefix = Some(prefix);
    }
    r
}

/// A child process killed when the test ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads the line a server prints once it listens, and the URL in it.
fn listening(child: &mut Child, what: &str) -> String {
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "{what} exited before listening");
    line.trim().rsplit(' ').next().unwrap().to_owned()
}

/// The Python upstream.
struct Upstream {
    _child: Running,
    url: String,
}

impl Upstream {
    fn start() -> Self {
        let python = std::env::var("IDEM_TEST_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/proxy_upstream.py");
        let mut child = Command::new(&python)
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {python} (the upstream is Python): {e}"));
        let port = listening(&mut child, "the Python upstream");
        Self {
            _child: Running(child),
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Every request that reached it, and the effects per operation id.
    async fn log(&self) -> Value {
        client()
            .get(format!("{}/_test/log", self.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until a request to `path` has reached it.
    async fn wait_for(&self, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.deliveries(path).await.is_empty() {
            assert!(
                Instant::now() < deadline,
                "the request never reached the upstream"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The deliveries to `path`.
    async fn deliveries(&self, path: &str) -> Vec<Value> {
        let log = self.log().await;
        log["deliveries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["path"] == path)
            .cloned()
            .collect()
    }
}

/// An `idem proxy` process.
struct Proxy {
    child: Running,
    url: String,
}

impl Proxy {
    fn start(records: &Records, upstream: &str, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("proxy")
            .args(["--listen", "127.0.0.1:0", "--upstream", upstream])
            .args(&records.args)
            .args(extra)
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let url = listening(&mut child, "idem proxy");
        Self {
            child: Running(child),
            url,
        }
    }

    fn pid(&self) -> u32 {
        self.child.0.id()
    }
}

/// Sends `sig` (`-KILL`, `-TERM`) to the process `pid`.
fn signal(sig: &str, pid: u32) {
    let sent = Command::new("kill").args([sig, &pid.to_string()]).status();
    assert!(sent.unwrap().success(), "kill {sig} {pid}");
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A `POST` to `path` from the caller `who` under `key`.
fn post(proxy: &str, path: &str, who: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("{proxy}{path}"))
        .header("authorization", format!("Bearer {who}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    r.headers().get(name).map(|v| v.to_str().unwrap())
}

/// Checks that `r` is a problem+json answer with `status`.
fn assert_problem(r: &reqwest::Response, status: u16) {
    assert_eq!(r.status(), status);
    assert_eq!(header(r, "content-type"), Some("application/problem+json"));
}

/// The operation id a delivery carried, checked to be a UUID.
fn op_of(delivery: &Value) -> String {
    let op = delivery["op"].as_str().unwrap().to_owned();
    assert!(uuid::Uuid::parse_str(&op).is_ok(), "not a UUID: {op}");
    op
}

fn received<'a>(delivery: &'a Value, name: &str) -> Vec<&'a str> {
    delivery["headers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h[0] == name)
        .map(|h| h[1].as_str().unwrap())
        .collect()
}

/// The whole HTTP contract through the proxy on one store.
async fn contract(mode: Mode) {
    let records = records(mode).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(
        &records,
        &upstream.url,
        &["--wait-ms", "20000", "--no-replay-header", "X-Request-Id"],
    );
    let p = proxy.url.as_str();
    let body = r#"{"amount": 1000}"#;

    // Racing duplicates reach the upstream once, and all get its answer.
    let racing: Vec<_> = (0..8)
        .map(|_| {
            let r =
                post(p, "/orders?x=1", "alice", "race-1", body).header("x-test-delay-ms", "500");
            tokio::spawn(r.header("x-client-header", "passed").send())
        })
        .collect();
    let mut answers = Vec::new();
    for r in racing {
        let r = r.await.unwrap().unwrap();
        let replayed = header(&r, "idempotent-replayed").is_some();
        let status = r.status();
        answers.push((status, replayed, r.bytes().await.unwrap()));
    }
    assert!(
        answers
            .iter()
            .all(|(s, _, b)| *s == 201 && *b == answers[0].2),
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|(_, r, _)| !r).count(),
        1,
        "one fresh answer"
    );
    let delivered = upstream.deliveries("/orders?x=1").await;
    assert_eq!(
        delivered.len(),
        1,
        "racing duplicates reached the upstream once"
    );
    let op = op_of(&delivered[0]);
    assert_ne!(
        op, "race-1",
        "the upstream gets the operation id, not the client's key"
    );
    assert_eq!(received(&delivered[0], "idempotency-key"), [op.as_str()]);
    assert_eq!(received(&delivered[0], "x-client-header"), ["passed"]);
    assert_eq!(received(&delivered[0], "authorization"), ["Bearer alice"]);
    assert_eq!(
        delivered[0]["body"], body,
        "the body passes through unchanged"
    );
    let first: Value = serde_json::from_slice(&answers[0].2).unwrap();
    assert_eq!(first["op"], op.as_str());

    // A repeat is the stored answer, byte for byte, with the upstream's
    // headers except the session's and the named ones.
    let fresh = post(p, "/orders", "alice", "replay-1", body)
        .send()
        .await
        .unwrap();
    assert_eq!(fresh.status(), 201);
    assert!(header(&fresh, "set-cookie").is_some() && header(&fresh, "x-request-id").is_some());
    assert!(header(&fresh, "idempotent-replayed").is_none());
    let again = post(p, "/orders", "alice", "replay-1", body)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    for name in ["location", "etag", "x-custom", "content-type"] {
        assert_eq!(
            header(&again, name),
            header(&fresh, name),
            "{name} is replayed"
        );
        assert!(header(&again, name).is_some(), "{name}");
    }
    assert!(
        header(&again, "set-cookie").is_none(),
        "Set-Cookie is never replayed"
    );
    assert!(
        header(&again, "x-request-id").is_none(),
        "--no-replay-header"
    );
    assert!(
        header(&again, "date").is_some(),
        "a replay gets a Date of its own"
    );
    let (fresh_body, again_body) = (fresh.bytes().await.unwrap(), again.bytes().await.unwrap());
    assert_eq!(fresh_body, again_body, "byte-identical");
    assert_eq!(upstream.deliveries("/orders").await.len(), 1);

    // The same key with another body: 422, and the upstream is not asked.
    let reused = post(p, "/orders", "alice", "replay-1", r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_problem(&reused, 422);
    // No key: 400. No caller: 401. Both problem+json, nothing forwarded.
    let no_key = client()
        .post(format!("{p}/orders"))
        .header("authorization", "Bearer alice")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_problem(&no_key, 400);
    let nobody = client()
        .post(format!("{p}/orders"))
        .header("idempotency-key", "k")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_problem(&nobody, 401);
    assert_eq!(upstream.deliveries("/orders").await.len(), 1);
    // Another caller's same key is another operation.
    let bob = post(p, "/orders", "bob", "replay-1", body)
        .send()
        .await
        .unwrap();
    assert_eq!(bob.status(), 201);
    assert!(header(&bob, "idempotent-replayed").is_none());
    let both = upstream.deliveries("/orders").await;
    assert_eq!(both.len(), 2);
    assert_ne!(op_of(&both[0]), op_of(&both[1]));

    // Other methods pass through untouched, key or not.
    let get = client()
        .get(format!("{p}/things/7?q=a"))
        .header("idempotency-key", "raw")
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 201);
    let gets = upstream.deliveries("/things/7?q=a").await;
    assert_eq!(gets.len(), 1);
    assert_eq!(gets[0]["method"], "GET");
    assert_eq!(
        gets[0]["op"], "raw",
        "an unguarded request keeps its headers"
    );

    // A 5xx is passed on and releases the key; the retry reaches the
    // upstream under the same operation id.
    let flaky = || post(p, "/flaky", "alice", "flaky-1", body).header("x-test-fail-first", "1");
    let failed = flaky().send().await.unwrap();
    assert_eq!(failed.status(), 503);
    let retried = flaky().send().await.unwrap();
    assert_eq!(retried.status(), 201);
    assert!(header(&retried, "idempotent-replayed").is_none());
    let tries = upstream.deliveries("/flaky").await;
    assert_eq!(tries.len(), 2);
    assert_eq!(
        op_of(&tries[0]),
        op_of(&tries[1]),
        "the same operation id after a release"
    );

    // A 4xx is stored and replayed.
    let missing = || post(p, "/missing", "alice", "missing-1", body).header("x-test-status", "404");
    assert_eq!(missing().send().await.unwrap().status(), 404);
    let replayed = missing().send().await.unwrap();
    assert_eq!(replayed.status(), 404);
    assert_eq!(header(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(upstream.deliveries("/missing").await.len(), 1);

    // A body over --max-body (1 MiB): 413, nothing forwarded.
    let big = "x".repeat((1 << 20) + 1);
    let too_large = post(p, "/big", "alice", "big-1", &big)
        .send()
        .await
        .unwrap();
    assert_eq!(too_large.status(), 413);
    assert!(upstream.deliveries("/big").await.is_empty());

    // Its own routes, under a prefix the upstream's paths do not use.
    let health = client()
        .get(format!("{p}/_idem/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let metrics = client()
        .get(format!("{p}/_idem/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        r#"idem_requests_total{outcome="replay"}"#,
        r#"idem_requests_total{outcome="mismatch"}"#,
        r#"idem_requests_total{outcome="released"}"#,
        r#"idem_proxy_upstream_total{outcome="answered"}"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}

#[tokio::test]
async fn the_contract_on_sqlite() {
    contract(Mode::Sqlite).await;
}

#[tokio::test]
async fn the_contract_on_sqlite_synchronous_normal() {
    contract(Mode::SqliteNormal).await;
}

#[tokio::test]
async fn the_contract_on_postgres() {
    contract(Mode::Postgres).await;
}

#[tokio::test]
async fn the_contract_on_mysql() {
    contract(Mode::MySql).await;
}

#[tokio::test]
async fn the_contract_tiered() {
    contract(Mode::Tiered).await;
}

#[tokio::test]
async fn the_contract_on_redis_alone() {
    contract(Mode::Redis).await;
}

/// Retries `send` until it is not `409`, within `within`.
async fn until_not_in_flight(
    send: impl Fn() -> reqwest::RequestBuilder,
    within: Duration,
) -> reqwest::Response {
    let deadline = Instant::now() + within;
    loop {
        let r = send().send().await.unwrap();
        if r.status() != 409 {
            return r;
        }
        assert!(Instant::now() < deadline, "still 409 after {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The time (seconds, the upstream's clock) a delivery arrived.
fn at(delivery: &Value) -> f64 {
    delivery["at"].as_f64().unwrap()
}

/// An upstream that times out or breaks the connection after acting: the
/// key is held (`409`) until its lease ends, then the retry reaches the
/// upstream again under the same operation id, never before, and its own
/// deduplication answers as the first time. A refused connection releases
/// at once.
async fn unknown_outcomes(mode: Mode) {
    let records = records(mode).await;
    let upstream = Upstream::start();
    let lease = Duration::from_millis(4000);
    let proxy = Proxy::start(
        &records,
        &upstream.url,
        &["--lease-ms", "4000", "--upstream-timeout-ms", "1000"],
    );
    let p = proxy.url.as_str();
    let body = r#"{"n": 1}"#;
    for (path, trouble, status) in [
        ("/slow", ("x-test-delay-ms", "1500"), 504),
        ("/crash", ("x-test-crash", "1"), 502),
    ] {
        let send = || post(p, path, "alice", path, body);
        let first = send().header(trouble.0, trouble.1).send().await.unwrap();
        assert_problem(&first, status);
        let wait: u64 = header(&first, "retry-after").unwrap().parse().unwrap();
        assert!(
            (1..=4).contains(&wait),
            "{path}: Retry-After {wait} within the lease"
        );
        // While the lease runs (the upstream gave up after 1 s of 4), the
        // key is held.
        let held = send().send().await.unwrap();
        assert_eq!(held.status(), 409, "{path}: held until the lease ends");
        let after = until_not_in_flight(send, lease * 4).await;
        assert_eq!(after.status(), 201, "{path}");
        let tries = upstream.deliveries(path).await;
        assert_eq!(tries.len(), 2, "{path}");
        let op = op_of(&tries[0]);
        assert_eq!(op, op_of(&tries[1]), "{path}: the same operation id");
        let gap = at(&tries[1]) - at(&tries[0]);
        assert!(
            gap >= lease.as_secs_f64() - 0.2,
            "{path}: the second delivery came {gap:.3} s after the first, inside the lease"
        );
        let log = upstream.log().await;
        assert_eq!(log["effects"][&op], 1, "{path}: one effect");
    }
    let metrics = client()
        .get(format!("{p}/_idem/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        r#"idem_requests_total{outcome="kept"} 2"#,
        r#"idem_proxy_upstream_total{outcome="timeout"} 1"#,
        r#"idem_proxy_upstream_total{outcome="unknown"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }

    // A refused connection: nothing was sent, so the key is free at once.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let nowhere = Proxy::start(&records, &format!("http://127.0.0.1:{port}"), &[]);
    for _ in 0..2 {
        let refused = post(&nowhere.url, "/x", "alice", "refused-1", body)
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 502, "released, not held");
    }
}

#[tokio::test]
async fn unknown_outcomes_hold_the_key_on_sqlite() {
    unknown_outcomes(Mode::Sqlite).await;
}

#[tokio::test]
async fn unknown_outcomes_hold_the_key_on_postgres() {
    unknown_outcomes(Mode::Postgres).await;
}

#[tokio::test]
async fn unknown_outcomes_hold_the_key_on_redis_alone() {
    unknown_outcomes(Mode::Redis).await;
}

/// An upstream status named by `--outcome-unknown-status` (a gateway of
/// the upstream's own that gave up while the service may still work) holds
/// the key like a time-out: passed on with `Retry-After`, `409` until the
/// lease ends, then the retry goes under the same operation id, never
/// before. A `5xx` not named still releases at once.
#[tokio::test]
async fn a_status_said_to_be_an_unknown_outcome_holds_the_key() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let lease = Duration::from_millis(3000);
    let proxy = Proxy::start(
        &records,
        &upstream.url,
        &["--lease-ms", "3000", "--outcome-unknown-status", "502,504"],
    );
    let p = proxy.url.as_str();
    let body = r#"{"n": 1}"#;
    let send = || post(p, "/behind-gateway", "alice", "gw-1", body);
    let first = send().header("x-test-status", "504").send().await.unwrap();
    assert_eq!(first.status(), 504);
    let wait: u64 = header(&first, "retry-after").unwrap().parse().unwrap();
    assert!(
        (1..=3).contains(&wait),
        "Retry-After {wait} within the lease"
    );
    let held = send().send().await.unwrap();
    assert_eq!(held.status(), 409, "held until the lease ends");
    let after = until_not_in_flight(send, lease * 4).await;
    assert_eq!(after.status(), 201);
    let tries = upstream.deliveries("/behind-gateway").await;
    assert_eq!(tries.len(), 2);
    assert_eq!(op_of(&tries[0]), op_of(&tries[1]), "the same operation id");
    let gap = at(&tries[1]) - at(&tries[0]);
    assert!(
        gap >= lease.as_secs_f64() - 0.2,
        "the second delivery came {gap:.3} s after the first, inside the lease"
    );
    // Not named: released, the retry reaches the upstream at once.
    let other = || post(p, "/unavailable", "alice", "gw-2", body);
    let failed = other().header("x-test-status", "503").send().await.unwrap();
    assert_eq!(failed.status(), 503);
    assert_eq!(other().send().await.unwrap().status(), 201);
    assert_eq!(upstream.deliveries("/unavailable").await.len(), 2);
}

/// A proxy killed with `kill -9` while the upstream works: a proxy started
/// again takes the key over after the lease, under the same operation id,
/// and the upstream acts once.
async fn killed_proxy_is_taken_over(mode: Mode) {
    let records = records(mode).await;
    let upstream = Upstream::start();
    let lease = Duration::from_millis(3000);
    let args = ["--lease-ms", "3000", "--upstream-timeout-ms", "2000"];
    let first = Proxy::start(&records, &upstream.url, &args);
    let body = r#"{"n": 2}"#;
    let url = first.url.clone();
    let inflight = tokio::spawn(
        post(&url, "/kill", "alice", "kill-1", body)
            .header("x-test-delay-ms", "1000")
            .send(),
    );
    upstream.wait_for("/kill").await;
    signal("-KILL", first.pid());
    assert!(
        inflight.await.unwrap().is_err(),
        "the client lost its connection"
    );
    let second = Proxy::start(&records, &upstream.url, &args);
    let send = || post(&second.url, "/kill", "alice", "kill-1", body);
    let r = until_not_in_flight(send, Duration::from_secs(15)).await;
    assert_eq!(r.status(), 201);
    let tries = upstream.deliveries("/kill").await;
    assert_eq!(tries.len(), 2);
    let gap = at(&tries[1]) - at(&tries[0]);
    assert!(
        gap >= lease.as_secs_f64() - 0.2,
        "taken over {gap:.3} s after the first delivery, inside its lease"
    );
    let op = op_of(&tries[0]);
    assert_eq!(
        op,
        op_of(&tries[1]),
        "taken over under the same operation id"
    );
    assert_eq!(upstream.log().await["effects"][&op], 1, "one effect");
    let replay = send().send().await.unwrap();
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    drop(first);
}

#[tokio::test]
async fn a_killed_proxy_is_taken_over_on_postgres() {
    killed_proxy_is_taken_over(Mode::Postgres).await;
}

#[tokio::test]
async fn a_killed_proxy_is_taken_over_on_mysql() {
    killed_proxy_is_taken_over(Mode::MySql).await;
}

/// Two proxies on one PostgreSQL: duplicates raced through both reach the
/// upstream once.
#[tokio::test]
async fn two_proxies_on_one_postgres_are_one() {
    let records = records(Mode::Postgres).await;
    let upstream = Upstream::start();
    let a = Proxy::start(&records, &upstream.url, &[]);
    let b = Proxy::start(&records, &upstream.url, &[]);
    for round in 0..5 {
        let key = format!("twin-{round}");
        let racing: Vec<_> = (0..12)
            .map(|i| {
                let p = if i % 2 == 0 { &a.url } else { &b.url };
                tokio::spawn(
                    post(p, "/twin", "alice", &key, r#"{"v":1}"#)
                        .header("x-test-delay-ms", "300")
                        .send(),
                )
            })
            .collect();
        let mut fresh = 0;
        for r in racing {
            let r = r.await.unwrap().unwrap();
            match r.status().as_u16() {
                201 if header(&r, "idempotent-replayed").is_none() => fresh += 1,
                201 | 409 => {}
                other => panic!("unexpected {other}"),
            }
        }
        assert_eq!(fresh, 1, "round {round}");
    }
    let tries = upstream.deliveries("/twin").await;
    assert_eq!(tries.len(), 5, "one delivery per key");
    // Once settled, either proxy replays the same bytes.
    let from_a = until_not_in_flight(
        || post(&a.url, "/twin", "alice", "twin-0", r#"{"v":1}"#),
        Duration::from_secs(10),
    )
    .await;
    let from_b = post(&b.url, "/twin", "alice", "twin-0", r#"{"v":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(from_a.bytes().await.unwrap(), from_b.bytes().await.unwrap());
}

/// SIGTERM: the listener closes, the request in flight finishes and its
/// answer is stored, and the proxy exits 0.
#[tokio::test]
async fn sigterm_drains_requests_in_flight() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let mut proxy = Proxy::start(&records, &upstream.url, &["--shutdown-grace-secs", "20"]);
    let url = proxy.url.clone();
    let inflight = tokio::spawn(
        post(&url, "/drain", "alice", "drain-1", "{}")
            .header("x-test-delay-ms", "1500")
            .send(),
    );
    upstream.wait_for("/drain").await;
    signal("-TERM", proxy.pid());
    let answer = inflight.await.unwrap().unwrap();
    assert_eq!(answer.status(), 201, "the request in flight finished");
    let status = tokio::task::spawn_blocking(move || proxy.child.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    // Its answer was stored: a proxy started again replays it.
    let again = Proxy::start(&records, &upstream.url, &[]);
    let replay = post(&again.url, "/drain", "alice", "drain-1", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    assert_eq!(upstream.deliveries("/drain").await.len(), 1);
}

/// Sends `request` as it is on a connection of its own and reads the whole
/// answer (the request asks for `Connection: close`).
async fn raw(url: &str, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// RFC 9110's hop-by-hop headers, on the way in and out; a chunked body
/// with `Expect: 100-continue`; `429` releases; a keyless request passes
/// through where keys are optional; the caller's credential is never
/// stored in clear.
#[tokio::test]
async fn headers_bodies_and_statuses_in_detail() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(&records, &upstream.url, &["--max-body", "1000"]);
    let p = proxy.url.as_str();

    // In: a chunked body, Expect, and headers that belong to this hop.
    let answer = raw(
        p,
        "POST /hop HTTP/1.1\r\nHost: shop.example\r\nAuthorization: Bearer alice\r\n\
         Idempotency-Key: hop-1\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\
         Expect: 100-continue\r\nConnection: close, X-Hop\r\nX-Hop: secret\r\nKeep-Alive: timeout=5\r\n\
         TE: trailers\r\nX-Test-Hop: 1\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert!(answer.contains("HTTP/1.1 201"), "{answer}");
    let delivered = upstream.deliveries("/hop").await;
    assert_eq!(delivered.len(), 1);
    let d = &delivered[0];
    assert_eq!(d["body"], "hello world");
    assert_eq!(received(d, "content-length"), ["11"]);
    assert_eq!(received(d, "host"), ["shop.example"], "Host passes through");
    for gone in ["transfer-encoding", "expect", "x-hop", "keep-alive", "te"] {
        assert!(received(d, gone).is_empty(), "{gone} was forwarded");
    }
    // Out: the header the upstream's Connection names is not passed on,
    // nor replayed.
    let lower = answer.to_ascii_lowercase();
    assert!(!lower.contains("x-upstream-hop"), "{answer}");
    let replay = client()
        .post(format!("{p}/hop"))
        .header("authorization", "Bearer alice")
        .header("idempotency-key", "hop-1")
        .header("content-type", "text/plain")
        .body("hello world")
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    assert!(header(&replay, "x-upstream-hop").is_none());
    assert!(header(&replay, "connection").is_none_or(|v| !v.contains("X-Upstream-Hop")));

    // An unguarded request whose chunked body goes over --max-body: 413.
    let big = "x".repeat(1500);
    let too_large = raw(
        p,
        &format!("PUT /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n", big.len()),
    )
    .await;
    assert!(too_large.starts_with("HTTP/1.1 413"), "{too_large}");

    // 429 is "try again later", not the request's outcome: released.
    let limited = || post(p, "/limited", "alice", "limited-1", "{}").header("x-test-status", "429");
    assert_eq!(limited().send().await.unwrap().status(), 429);
    let again = limited().send().await.unwrap();
    assert_eq!(again.status(), 429);
    assert!(header(&again, "idempotent-replayed").is_none());
    let tries = upstream.deliveries("/limited").await;
    assert_eq!(
        tries.len(),
        2,
        "released, so the retry reached the upstream"
    );
    assert_eq!(op_of(&tries[0]), op_of(&tries[1]));

    // The upstream's own 409 with Retry-After ("this operation is still in
    // flight", as when a retry after the lease reaches it while the first
    // delivery runs): released too, so a later retry gets the outcome.
    let busy = || {
        post(p, "/busy", "alice", "busy-1", "{}")
            .header("x-test-status", "409")
            .header("x-test-retry-after", "2")
    };
    assert_eq!(busy().send().await.unwrap().status(), 409);
    let again = busy().send().await.unwrap();
    assert_eq!(again.status(), 409);
    assert!(header(&again, "idempotent-replayed").is_none());
    assert_eq!(header(&again, "retry-after"), Some("2"));
    let tries = upstream.deliveries("/busy").await;
    assert_eq!(
        tries.len(),
        2,
        "released, so the retry reached the upstream"
    );
    assert_eq!(op_of(&tries[0]), op_of(&tries[1]));
    // A 409 without Retry-After is a conflict, the request's outcome: stored.
    let conflict =
        || post(p, "/conflict", "alice", "conflict-1", "{}").header("x-test-status", "409");
    assert_eq!(conflict().send().await.unwrap().status(), 409);
    let replayed = conflict().send().await.unwrap();
    assert_eq!(replayed.status(), 409);
    assert_eq!(header(&replayed, "idempotent-replayed"), Some("true"));
    assert_eq!(upstream.deliveries("/conflict").await.len(), 1);

    // The credential is hashed: not in the records, in any form.
    drop(proxy);
    let dir = records._dir.as_ref().unwrap().path().to_owned();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains("Bearer alice") && !text.contains("alice"),
            "stored in clear"
        );
    }

    // Keys optional: a request without one (or a caller) passes through.
    let lenient = Proxy::start(&records, &upstream.url, &["--require-key", "false"]);
    let open = client()
        .post(format!("{}/open", lenient.url))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 201);
    let opened = upstream.deliveries("/open").await;
    assert_eq!(opened.len(), 1);
    assert!(opened[0]["op"].is_null(), "no key was made up for it");
    let keyed = post(&lenient.url, "/open", "alice", "open-1", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(keyed.status(), 201);
    assert!(uuid::Uuid::parse_str(
        upstream.deliveries("/open").await[1]["op"]
            .as_str()
            .unwrap()
    )
    .is_ok());
}

/// Flags that cannot work are refused at start, saying why.
#[test]
fn bad_flags_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("p.db").display());
    for (flags, says) in [
        (vec!["--upstream", "https://svc"], "TLS"),
        (
            vec![
                "--upstream",
                "http://svc",
                "--database-url",
                "sqlite::memory:",
            ],
            "in-memory",
        ),
        (
            vec!["--upstream", "http://svc", "--methods", "PO ST"],
            "--methods",
        ),
        (
            vec![
                "--upstream",
                "http://svc",
                "--database-url",
                "postgres://postgres@127.0.0.1:5432/test",
                "--sqlite-synchronous",
                "normal",
            ],
            "--sqlite-synchronous applies to a SQLite",
        ),
        (
            vec![
                "--upstream",
                "http://svc",
                "--no-replay-header",
                "bad header",
            ],
            "--no-replay-header",
        ),
        (
            vec!["--upstream", "http://svc", "--scope-header", "bad header"],
            "--scope-header",
        ),
        (
            vec![
                "--upstream",
                "http://svc",
                "--outcome-unknown-status",
                "404",
            ],
            "--outcome-unknown-status",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["proxy", "--listen", "127.0.0.1:0"])
            .args(
                (!flags.contains(&"--database-url"))
                    .then_some(["--database-url", &db])
                    .into_iter()
                    .flatten(),
            )
            .args(&flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}

/// Flags that can work but not as asked are said at start, and the proxy
/// runs: an upstream time-out beyond 5/6 of the lease is brought down to
/// it, a TTL at or below the lease raised just above it.
#[tokio::test]
async fn flags_brought_within_the_lease_are_said_and_work() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("proxy")
        .args(["--listen", "127.0.0.1:0", "--upstream", &upstream.url])
        .args(&records.args)
        .args([
            "--lease-ms",
            "1200",
            "--upstream-timeout-ms",
            "60000",
            "--ttl-secs",
            "1",
        ])
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let url = listening(&mut child, "idem proxy");
    let mut proxy = Running(child);
    // The upstream answers after 5 s; the proxy gives it 1 s (5/6 of the
    // lease), not the minute asked for.
    let slow = post(&url, "/slow", "alice", "slow-1", "{}")
        .header("x-test-delay-ms", "5000")
        .send()
        .await
        .unwrap();
    assert_problem(&slow, 504);
    let _ = proxy.0.kill();
    let _ = proxy.0.wait();
    let mut said = String::new();
    std::io::Read::read_to_string(&mut proxy.0.stderr.take().unwrap(), &mut said).unwrap();
    assert!(said.contains("--upstream-timeout-ms (60000)"), "{said}");
    assert!(said.contains("--ttl-secs (1)"), "{said}");
}

/// An answer over `--max-response-body` whose status frees the key anyway
/// (a 5xx, a 429) passes its status on and frees the key: the retry
/// reaches the upstream again at once, where a 2xx or 4xx that large is
/// answered with a 502 that is stored. The upstream's `Retry-After` is
/// passed on with the status.
#[tokio::test]
async fn a_large_answer_that_frees_the_key_frees_it() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(
        &records,
        &upstream.url,
        &["--max-response-body", "1000", "--lease-ms", "3000"],
    );
    let p = proxy.url.as_str();
    for (status, key) in [("503", "big-503"), ("429", "big-429")] {
        for attempt in 1..=2 {
            let answer = post(p, &format!("/{key}"), "alice", key, "{}")
                .header("x-test-status", status)
                .header("x-test-body-bytes", "5000")
                .header("x-test-retry-after", "7")
                .send()
                .await
                .unwrap();
            assert_problem(&answer, status.parse().unwrap());
            assert_eq!(header(&answer, "retry-after"), Some("7"), "{status}");
            assert_eq!(upstream.deliveries(&format!("/{key}")).await.len(), attempt);
        }
    }
    // A 2xx that large: the upstream acted, and its answer cannot be kept.
    // The proxy's 502 is stored in its place: every retry gets it, after
    // the lease too, and the request never reaches the upstream again.
    let first = post(p, "/big-201", "alice", "big-201", "{}")
        .header("x-test-body-bytes", "5000")
        .send()
        .await
        .unwrap();
    assert_problem(&first, 502);
    assert!(header(&first, "idempotent-replayed").is_none());
    let said = first.text().await.unwrap();
    assert!(said.contains("upstream-answer-too-large"), "{said}");
    assert!(said.contains("201 Created"), "{said}");
    let lease = Duration::from_millis(3000);
    let started = Instant::now();
    for _ in 0..2 {
        let again = post(p, "/big-201", "alice", "big-201", "{}")
            .header("x-test-body-bytes", "5000")
            .send()
            .await
            .unwrap();
        assert_problem(&again, 502);
        assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
        assert_eq!(again.text().await.unwrap(), said);
        // the second time past the lease, when a held key is taken over
        tokio::time::sleep((lease + Duration::from_millis(200)).saturating_sub(started.elapsed()))
            .await;
    }
    assert_eq!(upstream.deliveries("/big-201").await.len(), 1);
    // A 4xx that is the request's outcome is kept the same way; another
    // body under the key is still a reuse.
    let refused = post(p, "/big-404", "alice", "big-404", "{}")
        .header("x-test-status", "404")
        .header("x-test-body-bytes", "5000")
        .send()
        .await
        .unwrap();
    assert_problem(&refused, 502);
    let reused = post(p, "/big-404", "alice", "big-404", r#"{"other":1}"#)
        .send()
        .await
        .unwrap();
    assert_problem(&reused, 422);
    assert_eq!(upstream.deliveries("/big-404").await.len(), 1);
}

/// A body trickled in a byte every 300 ms never stalls for the 2 s body
/// timeout, but falls below `--body-min-rate` (100 bytes a second): the
/// proxy cuts it off, sends nothing upstream and leaves the key free.
#[tokio::test]
async fn a_body_trickled_below_the_minimum_rate_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(
        &records,
        &upstream.url,
        &["--body-timeout-secs", "2", "--body-min-rate", "100"],
    );
    let addr = proxy.url.trim_start_matches("http://").to_owned();
    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut read_half, mut write_half) = stream.into_split();
    write_half
        .write_all(
            b"POST /trickle HTTP/1.1\r\nHost: svc\r\nAuthorization: Bearer alice\r\n\
              Idempotency-Key: trickle-1\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{",
        )
        .await
        .unwrap();
    let trickle = async {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if write_half.write_all(b" ").await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    let mut answer = Vec::new();
    let ended = async {
        let mut buf = [0u8; 1024];
        while let Ok(n @ 1..) = read_half.read(&mut buf).await {
            answer.extend_from_slice(&buf[..n]);
        }
    };
    // About 2 s; 1,000 bytes at 3 a second would take over five minutes.
    let cut = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            () = ended => {}
            () = trickle => {}
        }
    })
    .await;
    assert!(cut.is_ok(), "the trickled body was still open after 20 s");
    let text = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 4"),
        "a client error or a closed connection: {text}"
    );
    assert!(upstream.deliveries("/trickle").await.is_empty());
    let whole = post(&proxy.url, "/trickle", "alice", "trickle-1", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(whole.status(), 201, "the key was left free");
}

/// An upstream whose answer says `Transfer-Encoding: chunked` and a
/// `Content-Length` that is not its body's (the chunks frame it, RFC 9112)
/// has its body passed on framed by its own length, guarded, replayed or
/// passed through: bytes past a wrong `Content-Length` would be read as
/// the next answer on the client's connection.
#[tokio::test]
async fn an_answer_framed_twice_is_passed_on_framed_by_its_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let records = records(Mode::Sqlite).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                // The request read whole (its head, then Content-Length
                // bytes), then the answer, and the connection closed.
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse::<usize>().unwrap_or(0));
                        if got.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                let answer = "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\n\
                    Content-Length: 5\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
                    d\r\nhello, world!\r\n0\r\n\r\n";
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    let proxy = Proxy::start(&records, &upstream, &[]);
    let p = proxy.url.as_str();
    let guarded = "POST /twice HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
        Idempotency-Key: twice-1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    let through =
        "PUT /twice HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    for (what, request) in [
        ("the first answer", guarded),
        ("the replay", guarded),
        ("a request passed through", through),
    ] {
        let answer = raw(p, request).await;
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("{what}: no answer: {answer:?}"));
        let head = head.to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 201"), "{what}: {answer:?}");
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse::<usize>().unwrap());
        match length {
            Some(length) => {
                assert_eq!(body, "hello, world!", "{what}: {answer:?}");
                assert_eq!(length, body.len(), "{what}: {answer:?}");
            }
            None => {
                assert!(
                    head.contains("transfer-encoding: chunked"),
                    "{what}: {answer:?}"
                );
                assert_eq!(
                    body.to_ascii_lowercase(),
                    "d\r\nhello, world!\r\n0\r\n\r\n",
                    "{what}: {answer:?}"
                );
            }
        }
    }
}

/// Lookalikes of a guarded request: a guarded method in lower case is
/// refused (an upstream that upper-cases it would run a POST the layer
/// let through unguarded), and an `Idempotency_Key` header is not
/// forwarded beside the operation id (CGI-style servers read both names
/// as one).
#[tokio::test]
async fn a_guarded_request_spelled_otherwise_is_not_let_through() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(&records, &upstream.url, &[]);
    let p = proxy.url.as_str();
    for method in ["post", "Patch"] {
        let answer = raw(
            p,
            &format!(
                "{method} /lower HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
                 Idempotency-Key: lower-1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{method}: {answer}");
        assert!(answer.contains("method-case"), "{method}: {answer}");
    }
    assert!(upstream.deliveries("/lower").await.is_empty());
    // Two Content-Types: the fingerprint would read the body by one, the
    // upstream perhaps by the other.
    let twice = raw(
        p,
        "POST /twice HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
         Idempotency-Key: twice-1\r\nContent-Type: application/json\r\n\
         Content-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    .await;
    assert!(twice.starts_with("HTTP/1.1 400"), "{twice}");
    assert!(twice.contains("content-type-repeated"), "{twice}");
    assert!(upstream.deliveries("/twice").await.is_empty());
    // Other methods still pass through as they are.
    let get = raw(
        p,
        "GET /lower HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(get.starts_with("HTTP/1.1 201"), "{get}");

    let answer = post(p, "/underscore", "alice", "under-1", "{}")
        .header("idempotency_key", "the-clients-own")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 201);
    let delivered = upstream.deliveries("/underscore").await;
    assert_eq!(delivered.len(), 1);
    assert!(
        received(&delivered[0], "idempotency_key").is_empty(),
        "{delivered:?}"
    );
    assert_eq!(
        received(&delivered[0], "idempotency-key"),
        [op_of(&delivered[0])]
    );
}

/// A request body in a transfer coding other than chunked (`gzip,
/// chunked`) is refused with 501, guarded or not: the proxy takes only the
/// chunks off, and would hand the upstream compressed bytes with nothing
/// saying so.
#[tokio::test]
async fn a_transfer_coding_other_than_chunked_is_refused() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(&records, &upstream.url, &[]);
    for request in [
        "POST /coded HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: coded-1\r\n",
        "PUT /coded HTTP/1.1\r\nHost: x\r\n",
    ] {
        let answer = raw(
            &proxy.url,
            &format!(
                "{request}Transfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
        assert!(answer.contains("transfer-coding-not-supported"), "{answer}");
    }
    assert!(upstream.deliveries("/coded").await.is_empty());
}

/// On MySQL, a statement is at most `max_allowed_packet` (16 MiB on a
/// default MariaDB, the size of `--max-response-body`'s default): an
/// answer under the proxy's limit but over the server's could not be
/// stored, so its key was held and the request re-sent after every lease.
/// The answer the first request gets is the one its retry gets, and the
/// upstream sees the request once.
#[tokio::test]
async fn an_answer_the_database_cannot_hold_is_still_answered_the_same_on_mysql() {
    use sqlx::Connection;
    let records = records(Mode::MySql).await;
    let mut conn = sqlx::MySqlConnection::connect(&idem_test_support::mysql::mysql_url())
        .await
        .unwrap();
    let packet: u64 = sqlx::query_scalar("SELECT @@max_allowed_packet")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    // An answer of the packet's size, which the flag alone would keep.
    let size = packet;
    let flag = (packet + (1 << 20)).to_string();
    let upstream = Upstream::start();
    let proxy = Proxy::start(
        &records,
        &upstream.url,
        &["--lease-ms", "10000", "--max-response-body", &flag],
    );
    let p = proxy.url.as_str();
    let send = async || {
        let answer = post(p, "/huge", "alice", "huge", "{}")
            .header("x-test-body-bytes", size.to_string())
            .send()
            .await
            .unwrap();
        (answer.status(), answer.bytes().await.unwrap())
    };
    let (status, first) = send().await;
    let (again, second) = send().await;
    assert_eq!(
        again, status,
        "the retry got another answer ({size} bytes, max_allowed_packet {packet})"
    );
    assert_eq!(second, first);
    assert_eq!(upstream.deliveries("/huge").await.len(), 1);
}

/// A path with a dot segment is refused before anything is claimed or
/// sent: after the `--upstream` base path, `/../` would climb out of it
/// (the upstream resolves it), whatever the spelling.
#[tokio::test]
async fn a_path_that_climbs_out_of_the_upstream_base_is_refused() {
    let records = records(Mode::Sqlite).await;
    let upstream = Upstream::start();
    let proxy = Proxy::start(&records, &format!("{}/api", upstream.url), &[]);
    let p = proxy.url.as_str();
    for (method, target) in [
        ("GET", "/../_test/log"),
        ("POST", "/../secret"),
        ("POST", "/%2e%2e/secret"),
        ("GET", "/a/%2E%2e%2fsecret"),
    ] {
        let answer = raw(
            p,
            &format!(
                "{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
                 Idempotency-Key: dots-1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{target}: {answer}");
        assert!(answer.contains("bad-request-target"), "{target}: {answer}");
    }
    // Dots that are not a segment pass, under the base path.
    let answer = raw(
        p,
        "POST /v1.0/..x HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
         Idempotency-Key: dots-1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let log = upstream.log().await;
    let paths: Vec<&str> = log["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        ["/api/v1.0/..x"],
        "the key was claimed by a refused request, or one got through"
    );
}

/// `/_idem/healthz` answers anyone: when the store is away it says so
/// without the driver's message (hosts, ports, users); the log has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_says_the_store_is_away_without_saying_where() {
    let server = idem_test_support::redis::OwnServer::start();
    let port = server.url().rsplit(':').next().unwrap().to_owned();
    let records = Records {
        args: vec!["--database-url".to_owned(), server.url()],
        _dir: None,
        _schema: None,
        _db: None,
        _prefix: None,
    };
    let upstream = Upstream::start();
    let proxy = Proxy::start(&records, &upstream.url, &[]);
    let health = format!("{}/_idem/healthz", proxy.url);
    assert_eq!(client().get(&health).send().await.unwrap().status(), 200);
    drop(server);
    let away = client().get(&health).send().await.unwrap();
    assert_problem(&away, 503);
    let body: Value = away.json().await.unwrap();
    assert!(
        body["type"]
            .as_str()
            .unwrap()
            .ends_with("store-unavailable"),
        "{body}"
    );
    // Whatever the driver said (here Redis's "broken pipe"; elsewhere a
    // host name, a user, a database), the answer says only this.
    assert_eq!(
        body["detail"], "the store's read failed; the proxy's log says why",
        "{body}"
    );
    let text = body.to_string();
    for secret in [port.as_str(), "127.0.0.1", "refused", "os error", "pipe"] {
        assert!(!text.contains(secret), "{secret:?} in {text}");
    }
}
