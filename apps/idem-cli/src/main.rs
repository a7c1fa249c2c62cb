//! `idem`: the ops CLI for idem's stores.
//!
//! ```text
//! idem migrate --database-url URL
//! idem sweep   --database-url URL [--batch N]
//! idem inspect --database-url URL --scope S --key K [--show-body] [--json]
//! idem stats   --database-url URL [--json]
//! idem release --database-url URL --scope S --key K [--yes] [--force]
//! idem outbox  --database-url URL [--schema S] [--outbox-table T] [--limit N]
//! idem once    --database-url URL --scope S --key K [--lease-ms N] [--ttl-secs N]
//!              [--wait-ms N] [--store-failures] -- COMMAND [ARGS…]
//! idem proxy   --listen ADDR --upstream URL [--database-url URL] [--redis-url URL]
//!              [--scope-header NAME] [--lease-ms N] [--ttl-secs N] [--wait-ms N]
//!              [--max-body BYTES] [--upstream-timeout-ms N] [--methods POST,PATCH]
//!              [--no-replay-header NAME]…
//! ```
//!
//! `URL` is `sqlite:FILE`, `postgres://…` or `mysql://…` (also read from
//! `DATABASE_URL`); on PostgreSQL and MySQL, `--schema` (a PostgreSQL
//! schema, a MySQL database) and `--table` name the records table. Every
//! verb is written once, generic over the store ([`ops::Ops`]).

mod once;
mod ops;
mod proxy;
mod time;

use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idem_core::{sweep_all, Inspection, RecordState, Store, StoreError, StoreStats};
use idem_mysql::MySqlStore;
use idem_postgres::{PostgresStore, TableName};
use idem_sql::dialect::DialectKind;
use idem_sqlite::SqliteStore;
use ops::{is_missing_table, Ops};
use serde_json::json;

/// Operate idem's idempotency records on SQLite, PostgreSQL or MySQL.
#[derive(Debug, Parser)]
#[command(name = "idem", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the records table.
    Migrate(Target),
    /// Delete records past their retention, in bounded batches; prints how many went.
    Sweep {
        #[command(flatten)]
        target: Target,
        /// Records deleted per statement.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        batch: u64,
    },
    /// Show one record: state, lease, token, operation id, age, stored status.
    Inspect {
        #[command(flatten)]
        target: Target,
        /// The scope (tenant, client) the key belongs to.
        #[arg(long)]
        scope: String,
        /// The idempotency key.
        #[arg(long)]
        key: String,
        /// Also print the stored headers and body.
        #[arg(long)]
        show_body: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Free a stuck in-progress claim so that the next retry takes it over
    /// (same operation id). Asks for confirmation; refuses a completed
    /// record, and a claim whose lease is still running unless `--force`.
    Release {
        #[command(flatten)]
        target: Target,
        /// The scope (tenant, client) the key belongs to.
        #[arg(long)]
        scope: String,
        /// The idempotency key.
        #[arg(long)]
        key: String,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        /// Release even while the holder's lease runs: only when you know
        /// the holder is dead (its process is gone), since a retry then
        /// runs beside a holder that may still be working.
        #[arg(long)]
        force: bool,
    },
    /// The outbox: messages pending, sent, and dead-lettered (with why).
    /// `--schema` names its schema (MySQL: database), as for the records.
    Outbox {
        #[command(flatten)]
        target: Target,
        /// Dead-lettered messages to list (1 to 10,000).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
        /// The outbox table.
        #[arg(long, default_value = idem_outbox::outbox::DEFAULT_TABLE)]
        outbox_table: String,
    },
    /// Run a command once per key, across hosts: a repeat prints the first
    /// run's stdout and exits with its status without running it (cron on
    /// many hosts, a deploy step). Exits 65 if the key was used with
    /// another command line, 75 while another run holds it (or when the
    /// claim took over half the lease: nothing started).
    Once(Box<once::OnceArgs>),
    /// An HTTP gateway that gives the service behind it (in any language)
    /// the Idempotency-Key contract: duplicates reach it once, replays are
    /// the first answer, and the upstream gets the operation id as its
    /// Idempotency-Key. Prints `idem proxy listening on http://ADDR`.
    Proxy(Box<proxy::ProxyArgs>),
    /// Count records by state: in progress, completed, past retention, oldest.
    Stats {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
struct Target {
    /// `sqlite:FILE`, `postgres://…` or `mysql://…`.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// PostgreSQL and MySQL: the schema (MySQL: the database) of the records
    /// table (default: the search_path, or the URL's database).
    #[arg(long)]
    schema: Option<String>,
    /// PostgreSQL and MySQL: the records table.
    #[arg(long, default_value = "idem_records")]
    table: String,
    /// Tiered mode: the Redis in front of the database: `inspect` and
    /// `stats` show what it holds, `release` clears its in-flight marker.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// `--redis-url` names a Redis Cluster (one or more nodes, comma-separated).
    #[arg(long, env = "IDEM_REDIS_CLUSTER")]
    redis_cluster: bool,
    /// Tiered mode: the prefix of idem's keys in Redis.
    #[arg(long, env = "IDEM_REDIS_PREFIX", default_value = "idem")]
    redis_prefix: String,
    /// Connections in the database pool (the ops verbs need two).
    #[arg(skip = 2u32)]
    connections: u32,
    /// Redis alone: replicas a claim waits for (`idem proxy
    /// --redis-wait-replicas`); none for the other verbs.
    #[arg(skip)]
    wait_replicas: Option<idem_redis::WaitReplicas>,
    /// SQLite: commits synced at checkpoints only (`idem proxy
    /// --sqlite-synchronous normal`), not at each commit; off for the
    /// other verbs.
    #[arg(skip)]
    sqlite_synchronous_normal: bool,
}

impl Target {
    /// `--redis-url` for messages, each node's URL redacted.
    fn redacted_redis_url(&self) -> String {
        match &self.redis_url {
            Some(url) if self.redis_cluster => {
                url.split(',').map(redact).collect::<Vec<_>>().join(",")
            }
            Some(url) => redact(url),
            None => String::new(),
        }
    }

    /// The secrets of `--database-url` and `--redis-url`, for [`scrub`].
    fn secrets(&self) -> Vec<String> {
        // And a Redis Cluster's nodes', comma-separated, each with its own
        // (a password may hold a comma: the whole URL is read too).
        let mut found = secrets(&self.database_url);
        if self.redis_cluster {
            found.extend(self.database_url.split(',').flat_map(secrets));
        }
        for url in self.redis_url.iter().flat_map(|u| u.split(',')) {
            found.extend(secrets(url));
        }
        found
    }

    /// How to reach the Redis at `url` (a cluster's nodes comma-separated
    /// with `--redis-cluster`), under `--redis-prefix`.
    fn redis_config(&self, url: &str) -> idem_redis::RedisConfig {
        let config = if self.redis_cluster {
            idem_redis::RedisConfig::cluster(url.split(',').map(str::trim))
        } else {
            idem_redis::RedisConfig::new(url)
        };
        config.prefix(&self.redis_prefix)
    }

    /// The Redis in front of the database, if one was named.
    async fn redis(&self) -> Result<Option<idem_redis::RedisStore>, Failure> {
        let Some(url) = &self.redis_url else {
            return Ok(None);
        };
        let store = idem_redis::RedisStore::connect(self.redis_config(url))
            .await
            .map_err(|e| {
                format!(
                    "cannot connect to Redis at {}: {e}",
                    self.redacted_redis_url()
                )
            })?;
        Ok(Some(store))
    }
}

impl Command {
    /// The store the command works on (`once` names its own).
    fn target(&self) -> Option<&Target> {
        match self {
            Command::Migrate(target)
            | Command::Sweep { target, .. }
            | Command::Inspect { target, .. }
            | Command::Release { target, .. }
            | Command::Outbox { target, .. }
            | Command::Stats { target, .. } => Some(target),
            Command::Once(_) | Command::Proxy(_) => None,
        }
    }

    /// The secrets of the URLs the command was given, for [`scrub`].
    fn secrets(&self) -> Vec<String> {
        match self {
            Command::Once(args) => args.secrets(),
            Command::Proxy(args) => args.secrets(),
            other => other.target().map(Target::secrets).unwrap_or_default(),
        }
    }
}

/// One line on what Redis holds for a record.
fn redis_line(record: Option<&idem_core::Record>, now: idem_core::UnixMillis) -> String {
    match record {
        None => "nothing cached (the next duplicate reads the database)".to_owned(),
        Some(r) => match &r.state {
            RecordState::Completed { response, .. } => format!(
                "completed record cached for replay (status {}, expires {})",
                response.status,
                time::rfc3339(r.expires_at)
            ),
            RecordState::InProgress { locked_until, .. } if *locked_until > now => format!(
                "in-flight marker until {} (duplicates get 409 from Redis)",
                time::rfc3339(*locked_until)
            ),
            RecordState::InProgress { .. } => "an expired in-flight marker".to_owned(),
        },
    }
}

type Failure = Box<dyn std::error::Error>;

impl Target {
    fn table(&self) -> Result<TableName, Failure> {
        Ok(TableName::new(self.schema.as_deref(), &self.table)?)
    }

    /// Opens the SQLite store without migrating (and without creating a
    /// missing file) unless `create` is set.
    async fn sqlite(&self, create: bool) -> Result<SqliteStore, Failure> {
        let url = &self.database_url;
        if self.schema.is_some() || self.table != "idem_records" {
            return Err("--schema and --table apply to PostgreSQL and MySQL only".into());
        }
        let mut options = idem_sqlite::connect_options(url)?.create_if_missing(create);
        if self.sqlite_synchronous_normal {
            options = options.synchronous(sqlx::sqlite::SqliteSynchronous::Normal);
        }
        // Hosts starting at once (`idem once` from cron) open the same new
        // file together: switching it to WAL can meet SQLITE_BUSY before
        // any busy handler runs. That passes; wait it out, within the
        // acquire time-out.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let opened = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(self.connections.max(1))
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options.clone())
                .await;
            match opened {
                Ok(pool) => return Ok(SqliteStore::from_pool(pool)),
                Err(e)
                    if idem_sql::classify(&e) == idem_sql::ErrorClass::Unavailable
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(format!("cannot open {}: {e}", redact(url)).into()),
            }
        }
    }

    async fn postgres(&self) -> Result<PostgresStore, Failure> {
        let url = &self.database_url;
        let table = self.table()?;
        let options = sqlx::postgres::PgConnectOptions::from_str(url)?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(self.connections.max(1))
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", redact(url)))?;
        Ok(PostgresStore::new(pool, table)?)
    }

    async fn mysql(&self) -> Result<MySqlStore, Failure> {
        let url = DialectKind::driver_url(&self.database_url);
        let table = self.table()?;
        let options = sqlx::mysql::MySqlConnectOptions::from_str(&url)?;
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(self.connections.max(1))
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", redact(&url)))?;
        Ok(MySqlStore::new(pool, table)?)
    }
}

/// The largest statement the MySQL/MariaDB server at `target` takes
/// (`max_allowed_packet`): a record whose answer is larger cannot be
/// written.
async fn mysql_max_packet(target: &Target) -> Result<u64, Failure> {
    use sqlx::Connection;
    let url = DialectKind::driver_url(&target.database_url);
    let options = sqlx::mysql::MySqlConnectOptions::from_str(&url)?;
    let mut conn = sqlx::MySqlConnection::connect_with(&options)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", redact(&url)))?;
    let asked = sqlx::query_scalar::<_, u64>("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
        .fetch_one(&mut conn)
        .await;
    let _ = conn.close().await;
    Ok(asked.map_err(|e| format!("cannot read max_allowed_packet from {}: {e}", redact(&url)))?)
}

/// What is wrong with `target` before any connection is tried: an unknown
/// kind of URL, or flags that do not apply to it.
fn target_problem(target: &Target) -> Option<String> {
    let url = &target.database_url;
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        return None;
    }
    if target.wait_replicas.is_some() {
        return Some("--redis-wait-replicas applies to Redis alone (--database-url redis://…): with the records in a database, the database is the guard and Redis only a cache".to_owned());
    }
    match DialectKind::of_url(url) {
        None => Some(unsupported_url(url)),
        Some(DialectKind::Sqlite) if target.schema.is_some() || target.table != "idem_records" => {
            Some("--schema and --table apply to PostgreSQL and MySQL only".to_owned())
        }
        Some(_) => None,
    }
}

/// The store `target` names, its table made if missing: SQLite, PostgreSQL
/// or MySQL, with Redis in front of it when `--redis-url` is set (tiered:
/// the database decides), or Redis alone (`--database-url redis://…`).
fn unsupported_url(url: &str) -> String {
    // Only what is shaped as a URL is shown (its secrets masked): a
    // key/value connection string (`host=db password=…`) has no userinfo or
    // query to mask.
    let shown = if url.contains("://") || url.starts_with("sqlite:") {
        format!("{:?}", redact(url))
    } else {
        "(not shown: it is not a URL)".to_owned()
    };
    format!(
        "unsupported database URL {shown}: use sqlite:FILE, postgres://…, mysql://… or redis://…"
    )
}

/// The retention to keep records for: `--ttl-secs`, raised just above the
/// lease if it is not longer (said on stderr, by `who`), so that no record
/// ends while a request or run may still hold its key.
fn retention_above_lease(who: &str, ttl_secs: u64, lease_ms: u64) -> Duration {
    let lease = Duration::from_millis(lease_ms);
    let asked = Duration::from_secs(ttl_secs);
    if asked <= lease {
        eprintln!(
            "{who}: --ttl-secs ({ttl_secs}) is not longer than --lease-ms ({lease_ms} ms): records are kept {} ms, so that none ends while its key may still be held",
            lease_ms + 1
        );
    }
    asked.max(lease + Duration::from_millis(1))
}

async fn open_store(target: &Target) -> Result<Arc<dyn Store>, Failure> {
    use idem_sql::SqlRecords;
    let url = &target.database_url;
    if let Some(problem) = target_problem(target) {
        return Err(problem.into());
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        if target.redis_url.is_some() {
            // Not refused: REDIS_URL is often set for every process of a
            // host. Said, so that nobody believes in a tier that is not.
            eprintln!(
                "idem: --redis-url (or REDIS_URL) is not used: with a redis:// --database-url, Redis alone holds the records"
            );
        }
        let mut config = target.redis_config(url);
        if let Some(w) = target.wait_replicas {
            config = config.wait_replicas(w.replicas, w.timeout);
        }
        let store = idem_redis::RedisStore::connect(config)
            .await
            .map_err(|e| format!("cannot connect to Redis at {}: {e}", redact(url)))?;
        return Ok(Arc::new(store));
    }
    let sql: Arc<dyn Store> = match DialectKind::of_url(url) {
        Some(DialectKind::Sqlite) => {
            let store = target.sqlite(true).await?;
            store.migrate().await.map_err(explain)?;
            Arc::new(store)
        }
        Some(DialectKind::Postgres) => {
            let store = target.postgres().await?;
            store.migrate().await.map_err(explain)?;
            Arc::new(store)
        }
        Some(DialectKind::MySql) => {
            let store = target.mysql().await?;
            store.migrate().await.map_err(explain)?;
            Arc::new(store)
        }
        _ => return Err(unsupported_url(url).into()),
    };
    Ok(match target.redis().await? {
        Some(redis) => Arc::new(idem_redis::TieredStore::new(sql, redis)),
        None => sql,
    })
}

/// What stands in for a secret in anything the CLI prints.
const MASK: &str = "***";

/// `url` with its secrets masked, for messages: the password of the
/// userinfo (`postgres://user:***@host/db`) and the value of every query
/// parameter whose name holds "password" in any case (`?password=***`,
/// `&sslpassword=***`). `sqlite:` URLs carry no userinfo and keep theirs.
///
/// Passwords are often pasted unencoded, so the userinfo is taken to end at
/// the last `@` of the URL: a raw `@`, `/`, `?` or `#` in a password is
/// masked with it. An `@` elsewhere (in a query value) can only mask more
/// than the password, never less.
fn redact(url: &str) -> String {
    let url = redact_query(url);
    if url.starts_with("sqlite:") {
        return url;
    }
    match userinfo_password(&url) {
        Some((start, end)) => format!("{}{MASK}{}", &url[..start], &url[end..]),
        None => url,
    }
}

/// The byte range of the userinfo's password in `url` (after the scheme's
/// `://` if there is one, from the first `:` to the last `@`), if any.
fn userinfo_password(url: &str) -> Option<(usize, usize)> {
    let rest = url.find("://").map_or(0, |s| s + 3);
    let at = rest + url.get(rest..)?.rfind('@')?;
    let colon = rest + url.get(rest..at)?.find(':')?;
    Some((colon + 1, at))
}

/// `url` with the value of every password-named query parameter masked.
/// The query runs from the first `?` to the end (a fragment included: a
/// `#` may be part of an unencoded password).
fn redact_query(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|param| match param.split_once('=') {
            Some((name, _)) if names_a_password(name) => format!("{name}={MASK}"),
            _ => param.to_owned(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

/// Whether a (percent-encoded) query parameter name carries a password:
/// one whose name holds "password", or is `pass` (redis-rs reads a
/// `redis+unix://` URL's password from `?pass=`) or `pwd`, in any case.
fn names_a_password(name: &str) -> bool {
    let name = percent_decode(name).to_lowercase();
    name.contains("password") || name == "pass" || name == "pwd"
}

/// The secrets in `url` that [`redact`] masks, as written and decoded, for
/// [`scrub`].
fn secrets(url: &str) -> Vec<String> {
    let mut found = Vec::new();
    if !url.starts_with("sqlite:") {
        if let Some(password) = userinfo_password(url).and_then(|(s, e)| url.get(s..e)) {
            found.push(password.to_owned());
        }
    }
    if let Some((_, query)) = url.split_once('?') {
        for (name, value) in query.split('&').filter_map(|p| p.split_once('=')) {
            if names_a_password(name) {
                found.push(value.to_owned());
            }
        }
    }
    let decoded: Vec<String> = found.iter().map(|s| percent_decode(s)).collect();
    found.extend(decoded);
    found
}

/// `message` with every secret of [`secrets`] masked: the last line of
/// defence should a driver's error ever quote one. Secrets shorter than
/// four characters are left alone: masking every "a" or "1" would make
/// the message unreadable, and [`redact`] has masked the URL already.
fn scrub(message: &str, secrets: &[String]) -> String {
    let mut message = message.to_owned();
    for secret in secrets.iter().filter(|s| s.chars().count() >= 4) {
        message = message.replace(secret.as_str(), MASK);
    }
    message
}

/// Decodes `%XX` escapes; anything else (a malformed escape included) is
/// kept as it is, and invalid UTF-8 is replaced.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = (b == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .filter(|hex| hex.iter().all(u8::is_ascii_hexdigit))
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(decoded) => {
                out.push(decoded);
                i += 3;
            }
            None => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An error and its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}

/// A store error with its causes, and a hint when the table is missing.
fn explain(e: StoreError) -> Failure {
    let missing = is_missing_table(&e);
    let mut msg = chain(&e);
    if missing {
        msg.push_str(" (run `idem migrate` first)");
    }
    msg.into()
}

async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    let target = match cli.command {
        Command::Once(args) => return once::once(*args).await,
        Command::Proxy(args) => return proxy::proxy(*args).await,
        ref command => command.target().ok_or("no store named")?,
    };
    let create = matches!(cli.command, Command::Migrate(_));
    match DialectKind::of_url(&target.database_url) {
        Some(DialectKind::Sqlite) => run_with(&target.sqlite(create).await?, cli.command).await,
        Some(DialectKind::Postgres) => run_with(&target.postgres().await?, cli.command).await,
        Some(DialectKind::MySql) => run_with(&target.mysql().await?, cli.command).await,
        _ => Err(format!(
            "unsupported database URL {:?}: use sqlite:FILE, postgres://… or mysql://…",
            redact(&target.database_url)
        )
        .into()),
    }
}

/// Runs `command` on `store`: every verb, written once for every store.
async fn run_with<S: Ops>(store: &S, command: Command) -> Result<ExitCode, Failure> {
    match command {
        Command::Migrate(_) => {
            store.migrate_records().await.map_err(explain)?;
            println!("migrated: the records table is up to date");
        }
        Command::Sweep { batch, .. } => {
            let batch = usize::try_from(batch).unwrap_or(1000);
            let n = sweep_all(store, batch).await.map_err(explain)?;
            println!("swept {n} expired record{}", if n == 1 { "" } else { "s" });
        }
        Command::Inspect {
            target,
            scope,
            key,
            show_body,
            json,
        } => {
            let Some(seen) = store.inspect_record(&scope, &key).await.map_err(explain)? else {
                eprintln!("no record for scope {scope:?} and key {key:?}");
                return Ok(ExitCode::from(1));
            };
            let cached = match target.redis().await? {
                Some(redis) => Some(redis.peek(&scope, &key).await.map_err(explain)?),
                None => None,
            };
            let steps = steps(store, &seen).await.map_err(explain)?;
            // Whether a transaction holds it: a probe that needs more than
            // reading (PostgreSQL locks the row for it, which takes UPDATE
            // privilege); unknown where it fails, the record shown anyway.
            let held = if matches!(seen.record.state, RecordState::InProgress { .. }) {
                match store.row_held(&scope, &key).await {
                    Ok(held) => Some(held),
                    Err(e) => {
                        eprintln!(
                            "could not tell whether an open transaction holds this record: {}",
                            chain(&e)
                        );
                        None
                    }
                }
            } else {
                Some(false)
            };
            if json {
                let mut v = inspection_json(&seen, show_body);
                match held {
                    Some(true) => v["held_by_transaction"] = json!(true),
                    Some(false) => {}
                    None => v["held_by_transaction"] = json!(null),
                }
                if !steps.is_empty() {
                    v["steps"] = steps.iter().map(Step::json).collect();
                }
                if let Some((record, now)) = &cached {
                    v["redis"] = json!(redis_line(record.as_ref(), *now));
                }
                println!("{v}");
            } else {
                print!("{}", inspection_text(&seen, show_body, held == Some(true)));
                match held {
                    Some(true) => println!("{:<14}{}", "held:", HELD_BY_TRANSACTION),
                    Some(false) => {}
                    None => println!("{:<14}{}", "held:", HELD_UNKNOWN),
                }
                for step in &steps {
                    println!("{:<14}{}", format!("step {}:", step.index), step.line());
                }
                if let Some((record, now)) = &cached {
                    println!("{:<14}{}", "redis:", redis_line(record.as_ref(), *now));
                }
            }
        }
        Command::Release {
            target,
            scope,
            key,
            yes,
            force,
        } => {
            let Some(seen) = store.inspect_record(&scope, &key).await.map_err(explain)? else {
                eprintln!("no record for scope {scope:?} and key {key:?}");
                return Ok(ExitCode::from(1));
            };
            let RecordState::InProgress {
                token,
                locked_until,
            } = &seen.record.state
            else {
                eprintln!(
                    "refused: the record is completed; releasing it would let the operation run again"
                );
                return Ok(ExitCode::from(1));
            };
            if !force && store.row_held(&scope, &key).await.map_err(explain)? {
                eprintln!(
                    "refused: {HELD_BY_TRANSACTION}. Releasing it would let a retry run beside it; pass --force only if you know that transaction's process is gone"
                );
                return Ok(ExitCode::from(1));
            }
            if *locked_until > seen.now && !force {
                eprintln!(
                    "refused: the holder's lease runs until {} (for {} more): it may still be working, and a retry let in now would run beside it. Wait for the lease to end (the next retry then takes over by itself), or pass --force if you know the holder is dead",
                    time::rfc3339(*locked_until),
                    time::human(seen.now.until(*locked_until))
                );
                return Ok(ExitCode::from(1));
            }
            print!("{}", inspection_text(&seen, false, false));
            if !yes {
                use std::io::{BufRead, Write};
                print!("Release this claim so that the next retry runs the operation again? Type yes to confirm: ");
                std::io::stdout().flush()?;
                let mut answer = String::new();
                std::io::stdin().lock().read_line(&mut answer)?;
                if answer.trim() != "yes" {
                    println!("not released");
                    return Ok(ExitCode::from(1));
                }
            }
            let claim = idem_core::Claim {
                scope: scope.clone(),
                key: key.clone(),
                token: *token,
                operation_id: seen.record.operation_id,
                locked_until: idem_core::UnixMillis(0),
                takeover: false,
            };
            // In tiered mode, Redis's in-flight marker would answer 409 for
            // the rest of the lease: it goes with the claim.
            let redis = target.redis().await?;
            match store.release(&claim).await {
                Ok(()) => {
                    println!(
                        "released: the next retry with this key takes the claim over (operation id {})",
                        seen.record.operation_id
                    );
                    if let Some(redis) = &redis {
                        if let Err(e) = redis.forget(&scope, &key).await {
                            // The database's part is done: said as such,
                            // and what is left to do.
                            eprintln!(
                                "but Redis's in-flight marker could not be deleted ({}): a retry Redis answers is told 409 until {} at the latest; run this release again once Redis answers",
                                chain(&e),
                                time::rfc3339(*locked_until)
                            );
                            return Ok(ExitCode::from(2));
                        }
                    }
                    if redis.is_none() && *locked_until > seen.now {
                        // Forced before the lease ended: a Redis in front
                        // (tiered mode) still holds its in-flight marker.
                        eprintln!(
                            "note: if Redis is in front of this database (tiered mode), its in-flight marker still answers 409 until {}; run again with --redis-url to clear it too",
                            time::rfc3339(*locked_until)
                        );
                    }
                }
                Err(StoreError::ClaimLost) => {
                    eprintln!("not released: the record changed since it was read (completed or taken over)");
                    return Ok(ExitCode::from(1));
                }
                Err(e) => return Err(explain(e)),
            }
        }
        Command::Outbox {
            target,
            limit,
            outbox_table,
        } => {
            let table = idem_outbox::OutboxTable::new(target.schema.as_deref(), &outbox_table)
                .map_err(|e| -> Failure { format!("--outbox-table/--schema: {e}").into() })?;
            let (stats, dead) = store.outbox(&table, limit).await.map_err(|e| -> Failure {
                if idem_sql::classify(&e) == idem_sql::ErrorClass::MissingTable {
                    format!("there is no outbox table here ({})", table.name()).into()
                } else {
                    e.to_string().into()
                }
            })?;
            println!("pending:        {}", stats.pending);
            println!("sent:           {}", stats.sent);
            println!("dead-lettered:  {}", stats.dead);
            for d in dead {
                println!(
                    "dead: {} -> {} after {} attempt(s): {}",
                    d.message_id,
                    d.destination,
                    d.attempts,
                    // One line per message, whatever the broker said.
                    d.last_error.unwrap_or_default().replace(['\r', '\n'], " ")
                );
            }
        }
        Command::Once(_) | Command::Proxy(_) => {
            return Err("idem once and idem proxy open their own store".into())
        }
        Command::Stats { target, json } => {
            let stats = store.record_stats().await.map_err(explain)?;
            let redis_keys = match target.redis().await? {
                Some(redis) => Some(redis.count_keys().await.map_err(explain)?),
                None => None,
            };
            if json {
                let mut v = stats_json(&stats);
                if let Some(n) = redis_keys {
                    v["redis_keys"] = json!(n);
                }
                println!("{v}");
            } else {
                print!("{}", stats_text(&stats));
                if let Some(n) = redis_keys {
                    println!("redis keys:     {n} (cached records and in-flight markers)");
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What `inspect` and `release` say of a record whose row an open
/// transaction holds.
const HELD_UNKNOWN: &str = "unknown: the probe could not run (on PostgreSQL it locks the row for a moment, which takes UPDATE privilege on the table); if a claim in a transaction may hold it, its lease says nothing";
const HELD_BY_TRANSACTION: &str = "an open transaction holds this record (a claim held by the transaction): its holder is working whatever the lease says, and the key frees itself when that transaction ends";

/// The most steps `inspect` looks for.
const MAX_STEPS_SHOWN: usize = 100;

/// A step of a run (idem-once), as `inspect` shows it.
struct Step {
    index: usize,
    name: Option<String>,
    record: idem_core::Record,
}

impl Step {
    fn state(&self) -> &'static str {
        match self.record.state {
            RecordState::Completed { .. } => "completed",
            RecordState::InProgress { .. } => "in_progress",
        }
    }

    fn line(&self) -> String {
        let name = self
            .name
            .as_deref()
            .unwrap_or("(name stored when it completes)");
        match &self.record.state {
            RecordState::Completed { completed_at, .. } => {
                format!("{name}: completed {}", time::rfc3339(*completed_at))
            }
            RecordState::InProgress { locked_until, .. } => {
                format!(
                    "{name}: in progress, lease until {}",
                    time::rfc3339(*locked_until)
                )
            }
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({"index": self.index, "name": self.name, "state": self.state()})
    }
}

/// The steps the record's operation stored (`Operation::step`), in order.
async fn steps<S: Ops>(store: &S, seen: &Inspection) -> Result<Vec<Step>, StoreError> {
    let mut steps = Vec::new();
    for index in 0..MAX_STEPS_SHOWN {
        let key = idem_once::step_record_key(seen.record.operation_id, index);
        let Some(step) = store.inspect_record(&seen.record.scope, &key).await? else {
            break;
        };
        let name = match &step.record.state {
            RecordState::Completed { response, .. } => response
                .headers
                .iter()
                .find(|(n, _)| n == idem_once::STEP_NAME_HEADER)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned()),
            RecordState::InProgress { .. } => None,
        };
        steps.push(Step {
            index,
            name,
            record: step.record,
        });
    }
    Ok(steps)
}

fn inspection_text(seen: &Inspection, show_body: bool, held: bool) -> String {
    let r = &seen.record;
    let now = seen.now;
    let mut out = String::new();
    let mut line = |k: &str, v: String| out.push_str(&format!("{k:<14}{v}\n"));
    line("scope:", r.scope.clone());
    line("key:", r.key.clone());
    match &r.state {
        RecordState::InProgress {
            token,
            locked_until,
        } => {
            line("state:", "in progress".into());
            let lease = if held {
                format!(
                    "{} (held by an open transaction: its holder is working)",
                    time::rfc3339(*locked_until)
                )
            } else if *locked_until > now {
                format!(
                    "{} (held, ends in {})",
                    time::rfc3339(*locked_until),
                    time::human(now.until(*locked_until))
                )
            } else {
                format!(
                    "{} (ended {} ago: the next retry takes over)",
                    time::rfc3339(*locked_until),
                    time::human(locked_until.until(now))
                )
            };
            line("lease:", lease);
            line("token:", token.to_string());
        }
        RecordState::Completed { completed_at, .. } => {
            line("state:", "completed".into());
            line("lease:", "-".into());
            line("token:", "-".into());
            line("completed:", time::rfc3339(*completed_at));
        }
    }
    line("operation id:", r.operation_id.to_string());
    line("fingerprint:", r.fingerprint.to_hex());
    line(
        "created:",
        format!(
            "{} (age {})",
            time::rfc3339(r.created_at),
            time::human(r.created_at.until(now))
        ),
    );
    let expiry = if r.is_expired(now) {
        format!(
            "{} (past retention: the key is new again; the sweep removes it)",
            time::rfc3339(r.expires_at)
        )
    } else {
        format!(
            "{} (in {})",
            time::rfc3339(r.expires_at),
            time::human(now.until(r.expires_at))
        )
    };
    line("expires:", expiry);
    if let RecordState::Completed { response, .. } = &r.state {
        line(
            "status:",
            format!(
                "{} ({} header{}, {} byte body)",
                response.status,
                response.headers.len(),
                if response.headers.len() == 1 { "" } else { "s" },
                response.body.len()
            ),
        );
        if show_body {
            for (name, value) in &response.headers {
                line(
                    "header:",
                    format!("{name}: {}", printable(&String::from_utf8_lossy(value))),
                );
            }
            out.push_str("body:\n");
            out.push_str(&printable(&String::from_utf8_lossy(&response.body)));
            out.push('\n');
        }
    } else {
        line("status:", "- (no response yet)".into());
    }
    out
}

/// `text` safe to print on a terminal: control characters but newline
/// and tab (an escape sequence a stored answer carries could rewrite the
/// operator's screen or title) are shown escaped, `\u{1b}`.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn inspection_json(seen: &Inspection, show_body: bool) -> serde_json::Value {
    let r = &seen.record;
    let mut v = json!({
        "scope": r.scope,
        "key": r.key,
        "operation_id": r.operation_id.to_string(),
        "fingerprint": r.fingerprint.to_hex(),
        "created_at": time::rfc3339(r.created_at),
        "age_ms": r.created_at.until(seen.now).as_millis() as u64,
        "expires_at": time::rfc3339(r.expires_at),
        "past_retention": r.is_expired(seen.now),
        // the shortest retention any claim of the key asked for (null: a
        // record made before idem kept it)
        "shortest_retention_ms": r.shortest_retention.map(|d| d.as_millis() as u64),
    });
    match &r.state {
        RecordState::InProgress {
            token,
            locked_until,
        } => {
            v["state"] = json!("in_progress");
            v["token"] = json!(token.0);
            v["locked_until"] = json!(time::rfc3339(*locked_until));
            v["lease_expired"] = json!(*locked_until <= seen.now);
        }
        RecordState::Completed {
            response,
            completed_at,
        } => {
            v["state"] = json!("completed");
            v["completed_at"] = json!(time::rfc3339(*completed_at));
            v["status"] = json!(response.status);
            v["body_bytes"] = json!(response.body.len());
            if show_body {
                v["headers"] = response
                    .headers
                    .iter()
                    .map(|(n, val)| json!([n, String::from_utf8_lossy(val)]))
                    .collect();
                v["body"] = json!(String::from_utf8_lossy(&response.body));
            }
        }
    }
    v
}

fn stats_text(s: &StoreStats) -> String {
    let oldest = match s.oldest_created_at {
        Some(t) => format!("{} (age {})", time::rfc3339(t), time::human(t.until(s.now))),
        None => "- (no records)".into(),
    };
    format!(
        "in progress:    {} ({} with an expired lease)\ncompleted:      {}\npast retention: {} (waiting for the sweep)\noldest record:  {}\n",
        s.in_progress, s.leases_expired, s.completed, s.past_retention, oldest
    )
}

fn stats_json(s: &StoreStats) -> serde_json::Value {
    json!({
        "in_progress": s.in_progress,
        "leases_expired": s.leases_expired,
        "completed": s.completed,
        "past_retention": s.past_retention,
        "oldest_created_at": s.oldest_created_at.map(time::rfc3339),
        "now": time::rfc3339(s.now),
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let secrets = cli.command.secrets();
    // The proxy serves many requests at once, on every core; the other
    // verbs are one conversation with one store.
    let runtime = match cli.command {
        Command::Proxy(_) => tokio::runtime::Builder::new_multi_thread(),
        _ => tokio::runtime::Builder::new_current_thread(),
    }
    .enable_all()
    .build();
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {}", scrub(&e.to_string(), &secrets));
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The target of `url` with every other setting at its default.
    fn target_of(url: &str) -> Target {
        Target {
            database_url: url.to_owned(),
            schema: None,
            table: "idem_records".to_owned(),
            redis_url: None,
            redis_cluster: false,
            redis_prefix: "idem".to_owned(),
            connections: 2,
            wait_replicas: None,
            sqlite_synchronous_normal: false,
        }
    }

    /// `idem proxy --sqlite-synchronous normal` reaches the store's
    /// connections (`PRAGMA synchronous`: 2 is FULL, 1 NORMAL); the other
    /// verbs keep FULL.
    #[tokio::test]
    async fn the_sqlite_synchronous_setting_reaches_the_pool() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        for (normal, expected) in [(false, 2i64), (true, 1)] {
            let target = Target {
                sqlite_synchronous_normal: normal,
                ..target_of(&format!("sqlite:{}/{normal}.db", dir.path().display()))
            };
            let store = target.sqlite(true).await.unwrap_or_else(|e| panic!("{e}"));
            let setting: i64 = sqlx::query_scalar("PRAGMA synchronous")
                .fetch_one(store.pool())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(setting, expected, "normal: {normal}");
        }
    }

    /// A password with a comma in one server's URL is scrubbed whole.
    #[test]
    fn a_password_with_a_comma_is_found() {
        let target = target_of("redis://:s3cr,et@h:6379");
        let said = scrub("cannot connect with s3cr,et", &target.secrets());
        assert!(!said.contains("s3cr,et"), "{said}");
    }

    /// Every node of a Redis Cluster's `--database-url` has its password
    /// scrubbed, not the first alone.
    #[test]
    fn each_cluster_nodes_secret_is_found() {
        let target = Target {
            redis_cluster: true,
            ..target_of("redis://:first-pw@a:7000,redis://:second-pw@b:7001")
        };
        let found = target.secrets();
        let said = scrub("a: first-pw, b: second-pw", &found);
        assert!(
            !said.contains("first-pw") && !said.contains("second-pw"),
            "{said}"
        );
    }

    /// A stored body or header that carries a terminal escape sequence is
    /// printed with it escaped.
    #[test]
    fn control_characters_are_printed_escaped() {
        assert_eq!(printable("ok\n\tyes"), "ok\n\tyes");
        assert_eq!(printable("\u{1b}]0;owned\u{7}"), "\\u{1b}]0;owned\\u{7}");
        assert_eq!(printable("a\rb"), "a\\u{d}b");
    }

    /// redis-rs reads a unix socket's password from `?pass=`; a
    /// key/value connection string is not echoed at all.
    #[test]
    fn a_socket_password_and_a_connection_string_are_not_shown() {
        let url = "redis+unix:///run/redis.sock?db=1&pass=hunter22";
        assert_eq!(redact(url), "redis+unix:///run/redis.sock?db=1&pass=***");
        assert!(secrets(url).contains(&"hunter22".to_owned()));
        let said = unsupported_url("host=db user=app password=hunter22");
        assert!(!said.contains("hunter22"), "{said}");
    }

    #[test]
    fn urls_without_a_password_are_unchanged() {
        for url in [
            "postgres://host/db",
            "postgres://host:5432/db?sslmode=require",
            "postgres://user@host:5432/db",
            "postgresql://user@host/db?application_name=ops",
            "redis://127.0.0.1:6379/0",
        ] {
            assert_eq!(redact(url), url);
        }
    }

    #[test]
    fn the_userinfo_password_is_masked() {
        let cases = [
            (
                "postgres://user:secret@host/db",
                "postgres://user:***@host/db",
            ),
            (
                "postgresql://user:secret@host:5432/db?sslmode=require",
                "postgresql://user:***@host:5432/db?sslmode=require",
            ),
            // encoded `@` and `:` in the password
            (
                "postgres://user:p%40ss%3Aword@host/db",
                "postgres://user:***@host/db",
            ),
            // pasted unencoded: `@`, `:`, `/`, `#` and `?` in the password
            (
                "postgres://user:p@ss:w/o#r?d@host/db",
                "postgres://user:***@host/db",
            ),
            ("postgres://user:@host/db", "postgres://user:***@host/db"),
            (
                "redis://:secret@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            // no scheme: still a userinfo
            ("user:secret@host/db", "user:***@host/db"),
            ("mysql:user:secret@host", "mysql:***@host"),
        ];
        for (url, redacted) in cases {
            assert_eq!(redact(url), redacted, "{url}");
        }
    }

    #[test]
    fn password_query_parameters_are_masked() {
        let cases = [
            (
                "postgres://host/db?user=u&password=secret&sslmode=require",
                "postgres://host/db?user=u&password=***&sslmode=require",
            ),
            (
                "postgres://host/db?sslmode=verify-full&sslpassword=secret",
                "postgres://host/db?sslmode=verify-full&sslpassword=***",
            ),
            // any case, and an encoded name
            (
                "postgres://host/db?SSLPassword=a&PASSWORD=b&pass%77ord=c",
                "postgres://host/db?SSLPassword=***&PASSWORD=***&pass%77ord=***",
            ),
            // a `&`-free value runs to the end, a `#` included
            (
                "postgres://host/db?password=se#cret",
                "postgres://host/db?password=***",
            ),
            (
                "postgres://user:one@host/db?sslpassword=two&password=three",
                "postgres://user:***@host/db?sslpassword=***&password=***",
            ),
            // a parameter without a value has nothing to hide
            ("postgres://host/db?password", "postgres://host/db?password"),
        ];
        for (url, redacted) in cases {
            assert_eq!(redact(url), redacted, "{url}");
        }
    }

    #[test]
    fn an_at_sign_in_the_query_masks_more_never_less() {
        let url = "postgres://user:secret@host/db?application_name=me@work";
        let redacted = redact(url);
        assert!(!redacted.contains("secret"), "{redacted}");
        assert!(redacted.starts_with("postgres://user:***@"), "{redacted}");
    }

    #[test]
    fn sqlite_urls_are_untouched() {
        for url in [
            "sqlite:shop.db",
            "sqlite::memory:",
            "sqlite:/var/lib/a:b@c.db",
            "sqlite:///srv/user:x@y/idem.db?mode=rwc",
        ] {
            assert_eq!(redact(url), url);
        }
    }

    #[test]
    fn secrets_are_found_as_written_and_decoded_and_scrubbed() {
        let url = "postgres://u:p%40ssword@host/db?password=hunter22&sslpassword=ab";
        let found = secrets(url);
        for s in ["p%40ssword", "p@ssword", "hunter22", "ab"] {
            assert!(found.iter().any(|f| f == s), "{s} in {found:?}");
        }
        assert!(secrets("postgres://u@host/db?sslmode=disable").is_empty());
        assert!(secrets("sqlite:/a:b@c.db").is_empty());
        let message = "password p@ssword rejected; hunter22 too; ab stays";
        assert_eq!(
            scrub(message, &found),
            "password *** rejected; *** too; ab stays"
        );
    }

    #[test]
    fn percent_decoding_keeps_what_is_not_an_escape() {
        assert_eq!(percent_decode("a%40b%3a"), "a@b:");
        assert_eq!(percent_decode("%zz%+1%4"), "%zz%+1%4");
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("caf%C3%A9"), "café");
        assert_eq!(percent_decode("%FF"), "\u{fffd}");
    }

    #[test]
    fn every_command_names_its_target() {
        let cli = Cli::try_parse_from([
            "idem",
            "stats",
            "--database-url",
            "postgres://u:hunter22@h/db",
            "--redis-url",
            "redis://:redispass@h1,redis://:otherpass@h2",
            "--redis-cluster",
        ])
        .expect("valid arguments");
        let target = cli.command.target().expect("stats names its store");
        let found = cli.command.secrets();
        for s in ["hunter22", "redispass", "otherpass"] {
            assert!(found.iter().any(|f| f == s), "{s} in {found:?}");
        }
        assert_eq!(
            target.redacted_redis_url(),
            "redis://:***@h1,redis://:***@h2"
        );
        // `once` names its own store; its secrets are masked too.
        let once = Cli::try_parse_from([
            "idem",
            "once",
            "--database-url",
            "postgres://u:hunter22@h/db",
            "--redis-url",
            "redis://:redispass@h1",
            "--scope",
            "s",
            "--key",
            "k",
            "--",
            "true",
        ])
        .expect("valid arguments");
        let found = once.command.secrets();
        for s in ["hunter22", "redispass"] {
            assert!(found.iter().any(|f| f == s), "{s} in {found:?}");
        }
    }
}
