//! Starting and stopping the real `shop` binary for end-to-end tests.
#![allow(
    dead_code,
    unreachable_pub,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used
)]

pub mod fleet;
pub mod netns;
pub mod pgpair;
pub mod rcluster;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use idem_test_support::mysql::TestDatabase;
use idem_test_support::postgres::TestSchema;
use serde_json::Value;

/// A running `shop` process, killed when dropped.
pub struct Shop {
    child: Child,
    pub base: String,
    /// `http://host:port` of the gRPC API, when started with `--grpc-listen`.
    pub grpc: Option<String>,
}

impl Shop {
    /// Starts `shop` on a free port with the database at `db` and extra
    /// flags, and waits until `/healthz` answers.
    pub async fn start(db: &Db, extra: &[&str]) -> Shop {
        Shop::start_url(&db.url(), extra).await
    }

    /// Starts `shop` with the database at `url` (a [`Db`]'s, or the same
    /// through a fault proxy).
    pub async fn start_url(url: &str, extra: &[&str]) -> Shop {
        Shop::start_in_netns(None, url, extra).await
    }

    /// Starts `shop` inside the network namespace `netns` (listening on its
    /// clients' link), or on 127.0.0.1 without one.
    pub async fn start_in_netns(netns: Option<&netns::Netns>, url: &str, extra: &[&str]) -> Shop {
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.name, env!("CARGO_BIN_EXE_shop")]);
                c.args(["--listen", &format!("{}:0", ns.clients_ns_ip)]);
                c
            }
            None => {
                let mut c = Command::new(env!("CARGO_BIN_EXE_shop"));
                c.args(["--listen", "127.0.0.1:0"]);
                c
            }
        };
        let mut child = command
            .arg("--database-url")
            .arg(url)
            .args(extra)
            .env("SHOP_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start shop");
        let stdout = child.stdout.take().expect("shop stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("shop listening on ") {
                    let _ = tx.send((false, addr.to_owned()));
                } else if let Some(addr) = line.strip_prefix("shop gRPC listening on ") {
                    let _ = tx.send((true, addr.to_owned()));
                }
            }
        });
        // The gRPC line comes first, when there is one.
        let mut grpc = None;
        let base = loop {
            match rx
                .recv_timeout(Duration::from_secs(30))
                .expect("shop did not print its address within 30 s")
            {
                (true, addr) => grpc = Some(addr),
                (false, addr) => break addr,
            }
        };
        let shop = Shop { child, base, grpc };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = client.get(format!("{}/healthz", shop.base)).send().await {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "shop never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        shop
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Waits for the process to exit by itself (for crash tests).
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "shop did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends the process SIGTERM (a graceful shutdown).
    pub fn terminate(&self) {
        let sent = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(sent.success());
    }

    /// Whether the process has exited (crashed, or was killed).
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// `kill -9`: no unwinding, no response, no cleanup.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A database of the test's own: a SQLite file in a temporary directory, a
/// PostgreSQL schema, or a MySQL database; removed when dropped.
pub enum Db {
    Sqlite(tempfile::TempDir, PathBuf),
    Postgres(TestSchema),
    Mysql(TestDatabase),
    /// A PostgreSQL database of a server the test runs itself (a
    /// [`pgpair::PgPair`]), at this URL.
    PostgresAt(String),
}

impl Db {
    pub fn sqlite() -> Db {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("shop.db");
        Db::Sqlite(dir, db)
    }

    pub async fn postgres() -> Db {
        Db::Postgres(TestSchema::create("shop_test").await)
    }

    pub async fn mysql() -> Db {
        Db::Mysql(TestDatabase::create("shop_test").await)
    }

    /// Runs one statement on the test's database, on a connection of its
    /// own.
    pub async fn execute(&self, sql: &str) {
        match self {
            Db::Sqlite(..) => {
                let pool = sqlx::SqlitePool::connect(&self.url()).await.unwrap();
                sqlx::query(sql).execute(&pool).await.unwrap();
                pool.close().await;
            }
            Db::Postgres(_) | Db::PostgresAt(_) => {
                let pool = sqlx::PgPool::connect(&self.url()).await.unwrap();
                sqlx::query(sql).execute(&pool).await.unwrap();
                pool.close().await;
            }
            Db::Mysql(_) => {
                let pool = sqlx::MySqlPool::connect(&self.url()).await.unwrap();
                sqlx::query(sql).execute(&pool).await.unwrap();
                pool.close().await;
            }
        }
    }

    /// Runs one query of one integer (a count) on the test's database.
    pub async fn scalar(&self, sql: &str) -> i64 {
        match self {
            Db::Sqlite(..) => {
                let pool = sqlx::SqlitePool::connect(&self.url()).await.unwrap();
                let n = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
                pool.close().await;
                n
            }
            Db::Postgres(_) | Db::PostgresAt(_) => {
                let pool = sqlx::PgPool::connect(&self.url()).await.unwrap();
                let n = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
                pool.close().await;
                n
            }
            Db::Mysql(_) => {
                let pool = sqlx::MySqlPool::connect(&self.url()).await.unwrap();
                let n = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
                pool.close().await;
                n
            }
        }
    }

    pub fn url(&self) -> String {
        match self {
            Db::Sqlite(_, path) => format!("sqlite:{}", path.display()),
            Db::Postgres(schema) => schema.url(),
            Db::Mysql(db) => db.url(),
            Db::PostgresAt(url) => url.clone(),
        }
    }
}

/// Runs a test body once on each database (SQLite, PostgreSQL, MySQL):
/// each named `$name` gets a `sqlite`, a `postgres` and a `mysql` test in a
/// module of its name.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn sqlite() {
                    super::$name($crate::common::Db::sqlite()).await;
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn postgres() {
                    super::$name($crate::common::Db::postgres().await).await;
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn mysql() {
                    super::$name($crate::common::Db::mysql().await).await;
                }
            }
        )*
    };
}

pub const BODY: &str = r#"{"account_id":"acc_1","amount":1000,"currency":"EUR"}"#;

/// A `POST /payments` request with a client, key and body.
pub fn pay(
    client: &reqwest::Client,
    shop: &Shop,
    key: Option<&str>,
    body: &str,
) -> reqwest::RequestBuilder {
    let mut r = client
        .post(shop.url("/payments"))
        .header("authorization", "Bearer client-1")
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r
}

/// An answer, read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }
}

pub async fn read(r: reqwest::RequestBuilder) -> Answer {
    let resp = r.send().await.expect("request failed");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let replayed = headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = resp.bytes().await.expect("body").to_vec();
    Answer {
        status,
        replayed,
        headers,
        body,
    }
}

/// What client-1's payments charged account `id`.
pub async fn account(client: &reqwest::Client, shop: &Shop, id: &str) -> Value {
    client
        .get(shop.url(&format!("/accounts/{id}")))
        .header("authorization", "Bearer client-1")
        .send()
        .await
        .expect("account")
        .json()
        .await
        .expect("account json")
}

/// Three `shop` processes with `flags` on one PostgreSQL schema, 200
/// racing duplicates of 20 keys (the bank slow, so most arrive in flight):
/// each key runs once, every other answer is a byte-identical replay or a
/// `409`, every instance replays afterwards, and the bank charged 20 times.
pub async fn three_instances_race(flags: &[&str]) {
    use std::collections::HashMap;
    let db = Db::postgres().await;
    let shops = [
        Shop::start(&db, flags).await,
        Shop::start(&db, flags).await,
        Shop::start(&db, flags).await,
    ];
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let key = format!("cluster-key-{}", i % 20);
        let shop = &shops[i % 3];
        let r = pay(&client, shop, Some(&key), BODY).header("x-simulate", "bank-delay=200");
        tasks.push((key, tokio::spawn(read(r))));
    }
    let mut by_key: HashMap<String, Vec<Answer>> = HashMap::new();
    for (key, t) in tasks {
        by_key.entry(key).or_default().push(t.await.unwrap());
    }
    assert_eq!(by_key.len(), 20);
    for (key, answers) in &by_key {
        let fresh: Vec<_> = answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed)
            .collect();
        assert_eq!(
            fresh.len(),
            1,
            "{key}: exactly one request ran: {answers:?}"
        );
        for a in answers {
            match a.status {
                201 => assert_eq!(a.body, fresh[0].body, "{key}: replays are byte-identical"),
                409 => {
                    assert!(a.problem_type().ends_with("idempotency-key-in-use"));
                    assert!(a.headers.contains_key("retry-after"), "{key}: {a:?}");
                }
                // On a loaded machine a request may wait out the pool's
                // acquire time-out, or its turn under --claim-tx-limit,
                // before its claim: it was not run, and says so (the checks
                // below prove nothing ran twice).
                503 => {
                    let kind = a.problem_type();
                    assert!(
                        kind.ends_with("store-unavailable") || kind.ends_with("busy"),
                        "{key}: {a:?}"
                    );
                    assert!(a.headers.contains_key("retry-after"), "{key}: {a:?}");
                }
                other => panic!("{key}: unexpected status {other}: {a:?}"),
            }
        }
        // every instance replays the same bytes afterwards
        for shop in &shops {
            let again = read(pay(&client, shop, Some(key), BODY)).await;
            assert!(again.replayed, "{key}: {again:?}");
            assert_eq!(again.body, fresh[0].body);
        }
    }
    let acc = account(&client, &shops[0], "acc_1").await;
    assert_eq!(acc["payments"], 20, "{acc}");
    assert_eq!(acc["bank_charges"], 20, "{acc}");
    assert_eq!(acc["charged_total"], 20_000, "{acc}");
}

/// The Redis the tests use.
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Every way `shop` can keep its idempotency records: each keeps the whole
/// contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// SQLite, the claim committed first, the record with the payment.
    Sqlite,
    /// PostgreSQL, likewise.
    Postgres,
    /// MySQL / MariaDB, likewise.
    Mysql,
    /// PostgreSQL, `--claim-in-transaction`.
    ClaimInTx,
    /// PostgreSQL with Redis in front, and an in-process replay cache.
    Tiered,
    /// Records in Redis alone (payments in PostgreSQL).
    RedisAlone,
    /// Records in Redis alone, on a three-primary Redis Cluster.
    RedisCluster,
}

impl Mode {
    /// A database of its own for a test in this mode.
    pub async fn db(self) -> Db {
        match self {
            Mode::Sqlite => Db::sqlite(),
            Mode::Mysql => Db::mysql().await,
            _ => Db::postgres().await,
        }
    }

    /// The flags of this mode; Redis keys under a prefix of the test's own.
    pub fn flags(self, prefix: &str) -> Vec<String> {
        self.flags_with(prefix, &redis_url())
    }

    /// The flags of this mode, with the Redis at `redis` (the tests', or
    /// the same through a fault proxy).
    pub fn flags_with(self, prefix: &str, redis: &str) -> Vec<String> {
        let redis = |v: &mut Vec<String>| {
            v.extend([
                "--redis-url".to_owned(),
                redis.to_owned(),
                "--redis-prefix".to_owned(),
                prefix.to_owned(),
            ])
        };
        let mut v = Vec::new();
        match self {
            Mode::Sqlite | Mode::Postgres | Mode::Mysql => {}
            Mode::ClaimInTx => v.push("--claim-in-transaction".to_owned()),
            Mode::Tiered => {
                redis(&mut v);
                v.extend(["--replay-cache".to_owned(), "1000".to_owned()]);
            }
            Mode::RedisAlone => {
                redis(&mut v);
                v.extend(["--idem-store".to_owned(), "redis".to_owned()]);
            }
            Mode::RedisCluster => v.extend([
                "--redis-url".to_owned(),
                redis_cluster_urls(),
                "--redis-cluster".to_owned(),
                "--redis-prefix".to_owned(),
                prefix.to_owned(),
                "--idem-store".to_owned(),
                "redis".to_owned(),
            ]),
        }
        v
    }
}

/// The Redis Cluster the tests use (`bash scripts/test` starts it).
pub fn redis_cluster_urls() -> String {
    std::env::var("IDEM_TEST_REDIS_CLUSTER").unwrap_or_else(|_| {
        "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".to_owned()
    })
}

/// A Redis key prefix of one test's own; its keys are deleted when dropped.
pub struct RedisPrefix(pub String);

impl RedisPrefix {
    pub fn new(test: &str) -> RedisPrefix {
        RedisPrefix(format!("shop-{test}-{}", uuid::Uuid::new_v4().simple()))
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let mut urls = vec![redis_url()];
        urls.extend(redis_cluster_urls().split(',').map(str::to_owned));
        for url in urls {
            idem_test_support::redis::clear_prefix(&url, &self.0);
        }
    }
}

/// Starts `shop` in `mode` with `extra` flags.
pub async fn start_in(mode: Mode, db: &Db, prefix: &str, extra: &[&str]) -> Shop {
    start_routed(mode, &Route::direct(db), prefix, extra).await
}

/// Where a `shop` reaches its servers: straight, or through fault proxies.
#[derive(Debug, Clone)]
pub struct Route {
    /// The database's URL.
    pub database_url: String,
    /// The Redis's URL (used in the modes with Redis).
    pub redis_url: String,
    /// The network namespace `shop` runs in, if any.
    pub netns: Option<std::sync::Arc<netns::Netns>>,
}

impl Route {
    /// Straight to `db` and the tests' Redis.
    pub fn direct(db: &Db) -> Route {
        Route {
            database_url: db.url(),
            redis_url: redis_url(),
            netns: None,
        }
    }
}

/// Where the `host:port` of `url` starts and ends.
fn authority(url: &str) -> std::ops::Range<usize> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let start = start + url[start..].find('@').map_or(0, |i| i + 1);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    start..end
}

/// `url` with its `host:port` replaced by `addr`.
pub fn via(url: &str, addr: std::net::SocketAddr) -> String {
    let at = authority(url);
    format!("{}{addr}{}", &url[..at.start], &url[at.end..])
}

/// The `host:port` of `url`.
pub fn host_port(url: &str) -> String {
    url[authority(url)].to_owned()
}

/// Starts `shop` in `mode` with `extra` flags, reaching its servers by
/// `route`.
pub async fn start_routed(mode: Mode, route: &Route, prefix: &str, extra: &[&str]) -> Shop {
    let mut flags = mode.flags_with(prefix, &route.redis_url);
    flags.extend(extra.iter().map(|s| (*s).to_owned()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Shop::start_in_netns(route.netns.as_deref(), &route.database_url, &flags).await
}

/// Runs a test body once per [`Mode`] (the six, and Redis alone on a cluster): each `$name(mode, db)` gets one test
/// per mode in a module of its name.
#[macro_export]
macro_rules! in_every_mode {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use $crate::common::Mode;
                async fn run(mode: Mode) {
                    let db = mode.db().await;
                    super::$name(mode, db).await;
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() { run(Mode::Sqlite).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() { run(Mode::Postgres).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn mysql() { run(Mode::Mysql).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn claim_in_tx() { run(Mode::ClaimInTx).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn tiered() { run(Mode::Tiered).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis_alone() { run(Mode::RedisAlone).await }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis_cluster() { run(Mode::RedisCluster).await }
            }
        )*
    };
}

/// An HTTP client that signs in as `client-1` on every request that does
/// not name its own credentials.
pub fn signed_in() -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        reqwest::header::HeaderValue::from_static("Bearer client-1"),
    );
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .expect("an HTTP client")
}

/// xorshift64*: enough randomness for a load, reproducible from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    pub fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

/// A `redis-server` of the test's own on a free port (the shared one is
/// never stopped or flushed), killed when dropped; [`OwnRedis::restart`]
/// starts it again, empty, on the same port.
pub struct OwnRedis {
    child: Option<std::process::Child>,
    pub port: u16,
    /// Extra `redis-server` arguments (`--replicaof`).
    args: Vec<String>,
    /// Its working directory: a replica's full sync writes a `dump.rdb`
    /// there, which a restart must not load (nor the source tree keep).
    dir: tempfile::TempDir,
}

impl OwnRedis {
    pub fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// A replica of the Redis at `primary` (`host:port`).
    pub fn replica_of(primary: &str) -> Self {
        let (host, port) = primary.rsplit_once(':').expect("host:port");
        Self::start_with(vec!["--replicaof".into(), host.into(), port.into()])
    }

    fn start_with(args: Vec<String>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        Self::start_on(port, args)
    }

    /// A Redis on `port` with extra `args`.
    pub fn start_on(port: u16, args: Vec<String>) -> Self {
        let mut redis = Self {
            child: None,
            port,
            args,
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        redis.restart();
        redis
    }

    /// Runs a command on it with redis-cli; its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until `n` replicas are connected to it, online, and
    /// acknowledging writes: a replica reported online may still be loading
    /// what it was sent, and on a busy machine its first acknowledgements
    /// can take longer than a claim's `WAIT` time-out.
    pub fn wait_replicas_online(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let info = self.cli(&["INFO", "replication"]);
            let online = info
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                .count();
            // A replica (the middle of a chain) takes no writes to probe;
            // a primary is probed only once its replicas are online.
            let ready =
                online >= n && (info.contains("role:slave") || self.acknowledged_by(n) >= n);
            if ready {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "replicas never came online: {info}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How many of `n` replicas acknowledge a write within a second: a
    /// write and `WAIT` on one connection (`WAIT` counts this connection's
    /// writes).
    fn acknowledged_by(&self, n: usize) -> usize {
        use std::io::Write;
        let mut child = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("redis-cli");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(
                format!("SET idem-test-ack-probe 1\nWAIT {n} 1000\nDEL idem-test-ack-probe\n")
                    .as_bytes(),
            )
            .expect("write to redis-cli");
        let out = child.wait_with_output().expect("redis-cli");
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops it (as a crash would: its data is gone).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on its port, empty (a cluster node keeps its
    /// `nodes.conf`, and so rejoins), and waits until it accepts
    /// connections.
    pub fn restart(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(self.dir.path().join("dump.rdb"));
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (`bash scripts/test` installs it)");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.stop();
    }
}
