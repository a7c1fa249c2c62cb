//! `idem proxy`: an HTTP gateway that gives a service written in any
//! language the `Idempotency-Key` contract of idem's axum layer.
//!
//! The proxy is that layer in front of a forwarding handler: it claims the
//! key, fingerprints the request, replays a stored answer, answers
//! `400`/`409`/`413`/`422`, and sends the request on with its
//! `Idempotency-Key` replaced by the operation id (the same across
//! takeovers of one key), so that the upstream can make its own effect
//! safe. An answer the upstream gave is stored (`2xx`, `3xx`, `4xx`) or
//! releases the claim (`5xx`, a refused connection); when the outcome is
//! unknown (a timeout, a connection broken after sending), the claim is
//! kept until its lease runs out.

mod forward;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use clap::{ArgAction, Args};
use http::request::Parts;
use http::{Method, Request, StatusCode};
use idem_axum::{scope_missing, Idempotency, IdempotencyLayer};
use idem_core::{Policy, Store};
use idem_sql::dialect::DialectKind;
use metrics_exporter_prometheus::PrometheusHandle;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use forward::{problem, Upstream, UpstreamLimits};

/// What a record holds besides the answer's body: its headers (an
/// upstream's head is at most ~408 KiB, hyper's client buffer), key,
/// scope, fingerprint, and on MySQL the statement itself.
const RECORD_ROOM: u64 = 512 << 10;

/// The most one record may hold in the store `args` name, and what sets
/// it: MySQL's `max_allowed_packet` (read from the server), SQLite's
/// longest value (`SQLITE_MAX_LENGTH`), PostgreSQL's longest field, and
/// Redis's longest string (`proto-max-bulk-len`) when Redis holds the
/// records or a copy of them.
async fn record_limit(args: &ProxyArgs) -> Result<(u64, &'static str), crate::Failure> {
    let url = &args.database_url;
    let redis = url.starts_with("redis://") || url.starts_with("rediss://");
    let (mut largest, mut what) = match DialectKind::of_url(url) {
        Some(DialectKind::MySql) => (
            crate::mysql_max_packet(&args.target()).await?,
            "the MySQL server's max_allowed_packet (raise it for more)",
        ),
        Some(DialectKind::Sqlite) => (1_000_000_000, "SQLite's longest value"),
        Some(DialectKind::Postgres) => ((1 << 30) - 1, "PostgreSQL's longest field"),
        _ => (u64::MAX, "the store"),
    };
    if (redis || args.redis_url.is_some()) && largest > 512 << 20 {
        (largest, what) = (512 << 20, "Redis's longest string");
    }
    Ok((largest, what))
}

/// `idem proxy`'s flags (each also read from the environment).
#[derive(Debug, Args)]
pub(crate) struct ProxyArgs {
    /// The address to listen on, e.g. `0.0.0.0:8080` (port 0: any free port).
    #[arg(long, env = "IDEM_PROXY_LISTEN")]
    pub(crate) listen: String,
    /// The service behind the proxy: `http://HOST:PORT[/PATH]`.
    #[arg(long, env = "IDEM_PROXY_UPSTREAM")]
    pub(crate) upstream: String,
    /// Where records live: `sqlite:FILE`, `postgres://…`, `mysql://…`, or
    /// `redis://…` (Redis alone).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "sqlite:idem-proxy.db"
    )]
    pub(crate) database_url: String,
    /// PostgreSQL and MySQL: the schema (MySQL: the database) of the
    /// records table.
    #[arg(long, env = "IDEM_SCHEMA")]
    pub(crate) schema: Option<String>,
    /// PostgreSQL and MySQL: the records table.
    #[arg(long, env = "IDEM_TABLE", default_value = "idem_records")]
    pub(crate) table: String,
    /// Redis in front of the SQL database (tiered: the database decides).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub(crate) redis_url: Option<String>,
    /// The Redis URLs name a Redis Cluster (nodes comma-separated).
    #[arg(long, env = "IDEM_REDIS_CLUSTER")]
    pub(crate) redis_cluster: bool,
    /// The prefix of idem's keys in Redis.
    #[arg(long, env = "IDEM_REDIS_PREFIX", default_value = "idem")]
    pub(crate) redis_prefix: String,
    /// Redis alone (`--database-url redis://…`): a claim counts only once
    /// this many replicas have it (`WAIT`); fewer within
    /// `--redis-wait-timeout-ms` answers `503` and nothing is sent
    /// upstream. 0: do not wait.
    #[arg(long, env = "IDEM_REDIS_WAIT_REPLICAS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=16))]
    pub(crate) redis_wait_replicas: u32,
    /// SQLite only: `full` (the default) syncs every commit, so a record
    /// survives a power loss; `normal` syncs at checkpoints only: faster,
    /// and a record survives a crash of the proxy, not a power loss (a
    /// retry of a key whose record was lost is sent upstream again).
    #[arg(long, env = "IDEM_SQLITE_SYNCHRONOUS", value_enum)]
    pub(crate) sqlite_synchronous: Option<SqliteSynchronous>,
    /// How long a claim waits for `--redis-wait-replicas`, in milliseconds.
    #[arg(long, env = "IDEM_REDIS_WAIT_TIMEOUT_MS", default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=450))]
    pub(crate) redis_wait_timeout_ms: u64,
    /// The request header that says who the caller is; keys are kept apart
    /// per value (hashed, never stored in clear). A guarded request without
    /// it is answered `401`. Its value must stay the same across a
    /// caller's retries: a retry under another value (a token refreshed
    /// between them, a signature per request) is another caller's key, run
    /// again under a new operation id. With such credentials, name a header
    /// your gateway sets to the caller's stable id.
    #[arg(long, env = "IDEM_SCOPE_HEADER", default_value = "Authorization")]
    pub(crate) scope_header: String,
    /// A secret that keys the scope's hash (HMAC-SHA-256), so that a
    /// low-entropy credential (a Basic password) cannot be guessed from the
    /// records; the same on every proxy of a store. Without it, SHA-256.
    #[arg(long, env = "IDEM_SCOPE_SECRET", hide_env_values = true)]
    pub(crate) scope_secret: Option<String>,
    /// How long one delivery holds its key: a retry takes an unfinished
    /// one over only after it (a crashed proxy, an upstream that never
    /// answered).
    #[arg(long, env = "IDEM_LEASE_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
    pub(crate) lease_ms: u64,
    /// How long an answer is kept and replayed.
    #[arg(long, env = "IDEM_TTL_SECS", default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    pub(crate) ttl_secs: u64,
    /// A duplicate of a request in flight waits up to this long for its
    /// answer (then replays it); 0: `409` at once.
    #[arg(long, env = "IDEM_WAIT_MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub(crate) wait_ms: u64,
    /// How long one call to the store may take, in milliseconds: past it a
    /// claim answers `503` with `Retry-After` (nothing sent upstream), and
    /// a completion or release is left to the lease. A partition between
    /// the proxy and its store costs a bounded wait.
    #[arg(long, env = "IDEM_STORE_TIMEOUT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub(crate) store_timeout_ms: u64,
    /// The largest request body, in bytes (`413` beyond it).
    #[arg(long, env = "IDEM_MAX_BODY", default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub(crate) max_body: u64,
    /// The longest wait for the upstream's answer (default: 5/6 of the
    /// lease, at most 25 s). More than 5/6 of `--lease-ms` is brought down
    /// to it (and said at start): a delivery is over, with time to spare,
    /// before a retry may take its key over.
    #[arg(long, env = "IDEM_UPSTREAM_TIMEOUT_MS", value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    pub(crate) upstream_timeout_ms: Option<u64>,
    /// How long an idle connection to the upstream is kept for reuse; keep
    /// it below the upstream's keep-alive timeout (a request sent on a
    /// connection the upstream is closing has an unknown outcome).
    #[arg(long, env = "IDEM_UPSTREAM_IDLE_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub(crate) upstream_idle_timeout_ms: u64,
    /// The methods guarded (others pass through untouched).
    #[arg(
        long,
        env = "IDEM_METHODS",
        value_delimiter = ',',
        default_value = "POST,PATCH"
    )]
    pub(crate) methods: Vec<String>,
    /// A response header never replayed (repeatable); hop-by-hop headers,
    /// `Set-Cookie` and `Date` never are.
    #[arg(long = "no-replay-header", value_name = "NAME")]
    pub(crate) no_replay_header: Vec<String>,
    /// Whether a guarded request must carry `Idempotency-Key` (`400`
    /// without one); with `false` it passes through untouched.
    #[arg(long, env = "IDEM_REQUIRE_KEY", default_value_t = true, action = ArgAction::Set)]
    pub(crate) require_key: bool,
    /// An upstream `5xx` status whose outcome is unknown (repeatable, or
    /// comma-separated): the key is held until its lease runs out, as
    /// after a time-out, instead of released. For an upstream behind a
    /// gateway of its own, whose `504` (or `502`) may come while the
    /// service still works on the request: released, a retry would reach
    /// the service beside it. The answer is passed on with `Retry-After`
    /// (the lease's rest). By default none: every `5xx` releases.
    #[arg(long = "outcome-unknown-status", env = "IDEM_OUTCOME_UNKNOWN_STATUS", value_name = "STATUS", value_delimiter = ',', value_parser = clap::value_parser!(u16).range(500..=599))]
    pub(crate) outcome_unknown_status: Vec<u16>,
    /// The largest upstream answer kept for replay, in bytes; a larger one
    /// is answered `502` (`upstream-answer-too-large`), which is stored in
    /// its place when its status would have been (the upstream acted), and
    /// releases the key when it would not (a `5xx`, `429`).
    #[arg(long, env = "IDEM_MAX_RESPONSE_BODY", default_value_t = 16 << 20, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub(crate) max_response_body: u64,
    /// Connections in the database pool (default 2 on SQLite, whose
    /// writes take turns, 16 on the others).
    #[arg(long, env = "IDEM_DB_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) db_connections: Option<u32>,
    /// A client must send a request's head within this.
    #[arg(long, env = "IDEM_HEADER_TIMEOUT_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) header_timeout_secs: u64,
    /// A request body may stall this long between two chunks.
    #[arg(long, env = "IDEM_BODY_TIMEOUT_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) body_timeout_secs: u64,
    /// The average a request body must keep up once its first
    /// `--body-timeout-secs` are over, in bytes a second (0: no minimum).
    #[arg(long, env = "IDEM_BODY_MIN_RATE", default_value_t = 500, value_parser = clap::value_parser!(u64).range(0..=1 << 30))]
    pub(crate) body_min_rate: u64,
    /// Client connections served at once; more are closed at once, as is a new one while as many guarded requests run on whose clients went away.
    #[arg(long, env = "IDEM_MAX_CONNECTIONS", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) max_connections: u64,
    /// On SIGTERM, requests in flight may finish within this (keep it above
    /// the upstream timeout).
    #[arg(long, env = "IDEM_SHUTDOWN_GRACE_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub(crate) shutdown_grace_secs: u64,
}

/// `--sqlite-synchronous`: SQLite's `synchronous` setting, in WAL mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SqliteSynchronous {
    /// Every commit synced: it survives a power loss.
    Full,
    /// Synced at checkpoints: a commit survives a crash of the process,
    /// not a power loss.
    Normal,
}

impl ProxyArgs {
    /// Where records live, as the ops verbs name it.
    fn target(&self) -> crate::Target {
        crate::Target {
            database_url: self.database_url.clone(),
            schema: self.schema.clone(),
            table: self.table.clone(),
            redis_url: self.redis_url.clone(),
            redis_cluster: self.redis_cluster,
            redis_prefix: self.redis_prefix.clone(),
            connections: self.db_connections.unwrap_or(
                if self.database_url.starts_with("sqlite:") {
                    2
                } else {
                    16
                },
            ),
            wait_replicas: (self.redis_wait_replicas > 0).then(|| idem_redis::WaitReplicas {
                replicas: self.redis_wait_replicas,
                timeout: Duration::from_millis(self.redis_wait_timeout_ms),
            }),
            sqlite_synchronous_normal: self.sqlite_synchronous == Some(SqliteSynchronous::Normal),
        }
    }

    /// The secrets of its URLs, for [`crate::scrub`].
    pub(crate) fn secrets(&self) -> Vec<String> {
        let mut found = self.target().secrets();
        found.extend(self.scope_secret.iter().cloned());
        found
    }

    /// The claims' policy.
    fn policy(&self) -> Result<Policy, crate::Failure> {
        let mut policy = Policy::builder()
            .lease(Duration::from_millis(self.lease_ms))
            .retention(crate::retention_above_lease(
                "idem proxy",
                self.ttl_secs,
                self.lease_ms,
            ))
            .max_body(usize::try_from(self.max_body)?)
            .require_key(self.require_key)
            .store_timeout(Duration::from_millis(self.store_timeout_ms))
            .replay_all_headers();
        if self.wait_ms > 0 {
            policy = policy.wait_for_in_flight(Duration::from_millis(self.wait_ms));
        }
        for name in &self.no_replay_header {
            policy = policy.never_replay_header(name);
        }
        policy
            .build()
            .map_err(|e| format!("--no-replay-header: {e}").into())
    }

    /// How long to wait for the upstream: below the lease, always. A
    /// longer `--upstream-timeout-ms` is brought down to 5/6 of the lease
    /// (and said): a retry may take a key over when its lease ends, and the
    /// first delivery must be over by then.
    fn upstream_timeout(&self) -> Duration {
        let most = self.lease_ms * 5 / 6;
        match self.upstream_timeout_ms {
            Some(ms) if ms > most => {
                eprintln!(
                    "idem proxy: --upstream-timeout-ms ({ms}) is more than 5/6 of --lease-ms ({most} of {}): the upstream is given {most} ms, so that a delivery is over before a retry may take its key over; raise --lease-ms for more",
                    self.lease_ms
                );
                Duration::from_millis(most)
            }
            Some(ms) => Duration::from_millis(ms),
            None => Duration::from_millis(most.min(25_000)),
        }
    }

    /// The guarded methods.
    fn methods(&self) -> Result<Vec<Method>, crate::Failure> {
        self.methods
            .iter()
            .map(|m| {
                let m = m.trim().to_ascii_uppercase();
                Method::from_bytes(m.as_bytes())
                    .map_err(|_| format!("--methods: {m:?} is not an HTTP method").into())
            })
            .collect()
    }
}

/// What the proxy's own routes share.
#[derive(Clone)]
struct Shared {
    store: Arc<dyn Store>,
    metrics: PrometheusHandle,
    /// The URLs' secrets, scrubbed from what the log says of the store.
    secrets: Arc<[String]>,
}

/// Runs `idem proxy` until SIGTERM or SIGINT, then drains.
pub(crate) async fn proxy(args: ProxyArgs) -> Result<std::process::ExitCode, crate::Failure> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,idem=info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let policy = args.policy()?;
    let methods = args.methods()?;
    let timeout = args.upstream_timeout();
    let url = &args.database_url;
    if url.starts_with("sqlite:") && (url.contains(":memory:") || url.contains("mode=memory")) {
        return Err("--database-url: an in-memory SQLite database loses every record when the proxy stops (and is not shared by its connections); give a file, sqlite:FILE".into());
    }
    if args.sqlite_synchronous.is_some() && !url.starts_with("sqlite:") {
        return Err("--sqlite-synchronous applies to a SQLite --database-url (sqlite:FILE)".into());
    }
    if let Some(problem) = crate::target_problem(&args.target()) {
        return Err(problem.into());
    }
    if Duration::from_secs(args.shutdown_grace_secs) < timeout {
        warn!(
            grace_secs = args.shutdown_grace_secs,
            upstream_timeout_ms = timeout.as_millis(),
            "--shutdown-grace-secs is below the upstream timeout: a stop may cut requests in flight (their keys are then held until their lease runs out)"
        );
    }
    let mut upstream = Upstream::new(
        &args.upstream,
        UpstreamLimits {
            timeout,
            lease: policy.lease(),
            max_answer: usize::try_from(args.max_response_body)?,
            max_body: policy.max_body(),
            idle: Duration::from_millis(args.upstream_idle_timeout_ms),
        },
    )?;
    upstream.hold_statuses(&args.outcome_unknown_status);
    let scope_header =
        http::HeaderName::from_bytes(args.scope_header.as_bytes()).map_err(|_| {
            format!(
                "--scope-header {:?} is not a header name",
                args.scope_header
            )
        })?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    let store = crate::open_store(&args.target()).await?;
    // An answer kept for replay stays below what the store takes in one
    // record, with room for its headers and the rest of the record: a
    // larger one is answered as too large, and that answer stored.
    let (largest, what) = record_limit(&args).await?;
    let most = usize::try_from(largest.saturating_sub(RECORD_ROOM))
        .unwrap_or(usize::MAX)
        .max(1);
    if upstream.max_answer() > most {
        eprintln!(
            "idem proxy: --max-response-body ({}) is more than {what} ({largest} bytes) leaves for an answer: answers over {most} bytes are answered as too large",
            upstream.max_answer()
        );
        upstream.limit_answer(most);
    }

    let guarded = Router::new()
        .fallback(
            async |State(upstream): State<Upstream>,
                   idem: Option<Idempotency>,
                   request: Request<Body>| { upstream.forward(idem, request).await },
        )
        .with_state(upstream.clone())
        .layer(
            IdempotencyLayer::new(
                store.clone(),
                policy.clone(),
                hashed_scope(scope_header, args.scope_secret.clone()),
            )
            .methods(methods.clone()),
        )
        .layer(axum::middleware::from_fn_with_state(
            Arc::<[Method]>::from(methods),
            unforwardable,
        ));
    let app = Router::new()
        .route("/_idem/healthz", get(healthz))
        .route("/_idem/metrics", get(render_metrics))
        .with_state(Shared {
            store: store.clone(),
            metrics: metrics.clone(),
            secrets: args.secrets().into(),
        })
        .fallback_service(guarded);

    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    info!(%addr, upstream = %upstream.url(), store = store.kind(), "idem proxy is ready");
    // Tests and scripts read this line to learn the port (with --listen …:0).
    println!("idem proxy listening on http://{addr}");

    let upkeep = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            metrics.run_upkeep();
        }
    });
    let sweeper = tokio::spawn(sweep_forever(store, policy.retention()));
    let limits = idem_axum::serve::Limits {
        header_timeout: Duration::from_secs(args.header_timeout_secs),
        body_timeout: Duration::from_secs(args.body_timeout_secs),
        body_min_rate: args.body_min_rate,
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        grace: Duration::from_secs(args.shutdown_grace_secs),
    };
    idem_axum::serve::serve(listener, app, limits, stop_signal()).await;
    upkeep.abort();
    sweeper.abort();
    info!("idem proxy stopped");
    Ok(std::process::ExitCode::SUCCESS)
}

/// Refuses, before anything is claimed, what the proxy cannot forward as
/// the client meant it:
///
/// - a guarded method spelled in another case (`post`): to HTTP it is
///   another method, which the layer would pass through unguarded, with
///   the client's own `Idempotency-Key`, while many upstreams (Flask,
///   Django, Symfony) upper-case it and run it as the guarded one (`400`);
/// - a transfer coding other than `chunked` (`gzip, chunked`): the server
///   takes the chunks off, not the rest, and `Transfer-Encoding` belongs
///   to this hop alone, so the upstream would get compressed bytes with
///   nothing saying so (`501`, as RFC 9112 asks of a coding not
///   understood);
/// - a path with a dot segment (`/../admin`, `/%2e%2e/admin`): put after
///   the `--upstream` base path, the upstream would resolve it out of that
///   path, and the fingerprint would tell apart spellings of one target
///   (`400`);
/// - a guarded request with `Content-Type` more than once: the fingerprint
///   reads the body by the first, an upstream may by the last, and two
///   bodies one takes for the same request the other may not (`400`).
async fn unforwardable(
    State(guarded): State<Arc<[Method]>>,
    request: Request<Body>,
    next: axum::middleware::Next,
) -> Response {
    let mut codings = request
        .headers()
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty());
    if let Some(other) = codings.find(|c| !c.eq_ignore_ascii_case(b"chunked")) {
        return problem(
            StatusCode::NOT_IMPLEMENTED,
            "transfer-coding-not-supported",
            "The request's transfer coding is not supported",
            format!(
                "only chunked is taken off the body, not {:?}: send the body as it is, or say its coding in Content-Encoding",
                String::from_utf8_lossy(other)
            ),
        );
    }
    if has_dot_segment(request.uri().path()) {
        return problem(
            StatusCode::BAD_REQUEST,
            "bad-request-target",
            "The request target cannot be forwarded",
            "its path holds a dot segment (. or ..), which the upstream would resolve, or a % encoded more than 4 times over: send the path it stands for",
        );
    }
    let method = request.method().as_str();
    if guarded.iter().any(|g| g.as_str() == method)
        && request
            .headers()
            .get_all(http::header::CONTENT_TYPE)
            .iter()
            .nth(1)
            .is_some()
    {
        return problem(
            StatusCode::BAD_REQUEST,
            "content-type-repeated",
            "The request names its Content-Type more than once",
            "send one Content-Type: the body's meaning must be one for the proxy and the upstream",
        );
    }
    if let Some(meant) = guarded
        .iter()
        .find(|g| g.as_str() != method && g.as_str().eq_ignore_ascii_case(method))
    {
        return problem(
            StatusCode::BAD_REQUEST,
            "method-case",
            "The method is spelled in another case than the one guarded",
            format!("methods are case-sensitive: send {meant}, not {method}"),
        );
    }
    next.run(request).await
}

/// How many times over a `%` may be percent-encoded in a path (`%25`,
/// `%2525`, …) before the path is refused.
const PERCENT_LAYERS: usize = 4;

/// Whether `path` holds a segment `.` or `..`, also spelled with `%2e`
/// (or `%252e`, for a server that decodes twice), between backslashes or
/// encoded slashes (`%2f`, `%5c`), which some servers take for `/`, or
/// followed by parameters (`..;x`, which Tomcat, Jetty and Spring drop
/// before they resolve the path). A percent sign encoded more than
/// [`PERCENT_LAYERS`] times over counts as one too: no server decodes that
/// deep, and peeling every layer of a long path would cost time
/// quadratic in its length.
fn has_dot_segment(path: &str) -> bool {
    let mut path = path.to_ascii_lowercase();
    for _ in 0..PERCENT_LAYERS {
        if !path.contains("%25") {
            break;
        }
        path = path.replace("%25", "%");
    }
    if path.contains("%25") {
        return true;
    }
    path.replace("%2e", ".")
        .replace("%2f", "/")
        .replace("%5c", "/")
        .replace("%3b", ";")
        .split(['/', '\\'])
        .map(|segment| segment.split(';').next().unwrap_or_default())
        .any(|segment| segment == "." || segment == "..")
}

/// The scope of a request: a hash of the one value of `header` (a token is
/// never stored in clear), keyed by `secret` if there is one; a request
/// without it, or with it twice, is refused with `401`.
fn hashed_scope(
    header: http::HeaderName,
    secret: Option<String>,
) -> impl Fn(&Parts) -> Result<String, Response> + Send + Sync + 'static {
    move |parts: &Parts| {
        let mut values = parts.headers.get_all(&header).iter();
        match (values.next(), values.next()) {
            (Some(value), None) if !value.as_bytes().trim_ascii().is_empty() => {
                Ok(scope_of(value.as_bytes(), secret.as_deref()))
            }
            _ => Err(scope_missing(format!(
                "send the {header} header exactly once: idem proxy keeps each caller's keys apart by it"
            ))),
        }
    }
}

/// `sha256:<hex>` of `value`, or `hmac:<hex>` of it keyed by `secret`.
fn scope_of(value: &[u8], secret: Option<&str>) -> String {
    use hmac::{Hmac, Mac};
    use std::fmt::Write;
    let (kind, digest): (&str, Vec<u8>) = match secret {
        Some(secret) => match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
            Ok(mut mac) => {
                mac.update(value);
                ("hmac", mac.finalize().into_bytes().to_vec())
            }
            // HMAC takes a key of any length; kept total all the same.
            Err(_) => ("sha256", Sha256::digest(value).to_vec()),
        },
        None => ("sha256", Sha256::digest(value).to_vec()),
    };
    let mut scope = String::with_capacity(kind.len() + 1 + 64);
    scope.push_str(kind);
    scope.push(':');
    for byte in digest {
        // Every request's scope: written in place, no string per byte.
        let _ = write!(scope, "{byte:02x}");
    }
    scope
}

/// `GET /_idem/healthz`: `200` when the store answers a read within 2 s.
async fn healthz(State(shared): State<Shared>) -> Response {
    let read = tokio::time::timeout(
        Duration::from_secs(2),
        shared.store.get("idem-proxy", "healthz"),
    )
    .await;
    match read {
        Ok(Ok(_)) => "ok".into_response(),
        Ok(Err(e)) => {
            // Unauthenticated: the answer names no host, user or driver
            // message; the log has them (its secrets scrubbed).
            info!(
                error = %crate::scrub(&crate::chain(&e), &shared.secrets),
                "healthz: the store's read failed"
            );
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "The store cannot be reached",
                "the store's read failed; the proxy's log says why",
            )
        }
        Err(_) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "The store cannot be reached",
            "no answer within 2 s",
        ),
    }
}

/// `GET /_idem/metrics`: Prometheus text.
async fn render_metrics(State(shared): State<Shared>) -> Response {
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        shared.metrics.render(),
    )
        .into_response()
}

/// Removes records past their retention, in bounded batches, forever.
async fn sweep_forever(store: Arc<dyn Store>, retention: Duration) {
    let every = (retention / 2).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        match idem_core::sweep_all(&*store, 500).await {
            Ok(0) => {}
            Ok(n) => {
                metrics::counter!("idem_records_swept_total").increment(n);
                info!(swept = n, "removed expired idempotency records");
            }
            Err(e) => warn!(error = %e, "sweep failed; will try again"),
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        warn!("cannot watch SIGTERM and SIGINT; stop the proxy with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    info!("stopping: no new connections; requests in flight may finish");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_is_a_hash_and_a_secret_keys_it() {
        let plain = scope_of(b"Bearer alice", None);
        assert!(
            plain.starts_with("sha256:") && plain.len() == 7 + 64,
            "{plain}"
        );
        assert!(!plain.contains("alice"));
        assert_ne!(plain, scope_of(b"Bearer bob", None));
        let keyed = scope_of(b"Bearer alice", Some("s3cret"));
        assert!(keyed.starts_with("hmac:"), "{keyed}");
        assert_ne!(keyed, scope_of(b"Bearer alice", Some("other")));
        assert_eq!(keyed, scope_of(b"Bearer alice", Some("s3cret")));
    }

    #[test]
    fn dot_segments_in_any_spelling_are_found() {
        for path in [
            "/..",
            "/../admin",
            "/a/./b",
            "/a/.",
            "/%2e%2e/admin",
            "/%2E./admin",
            "/.%2e/admin",
            "/a%2f..%2fadmin",
            "/a\\..\\admin",
            "/a%5c..",
            "/..;/admin",
            "/..;jsessionid=1/admin",
            "/.%3b/admin",
            "/%252e%252e/admin",
            "/%25252e./admin",
            "..",
            "/%2525252525",
        ] {
            assert!(has_dot_segment(path), "{path}");
        }
        // A long path of `%` encoded layer on layer is refused after a
        // few layers, not peeled layer by layer (quadratic in its length).
        let deep = format!("/%{}", "25".repeat(30_000));
        assert!(has_dot_segment(&deep));
        for path in [
            "/",
            "/a/b",
            "/v1.0/file.txt",
            "/.well-known/x",
            "/a/.../b",
            "/a..b/..c",
            "/%2e%2e%2e",
            "/a;..",
            "/x;/b",
            "/%2525",
            "/%25252525",
        ] {
            assert!(!has_dot_segment(path), "{path}");
        }
    }
}
