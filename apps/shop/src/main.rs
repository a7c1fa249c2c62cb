//! `shop`: a demo payments service that cannot charge twice.
//!
//! `POST /payments` is guarded by idem's layer; the handler charges a fake
//! bank under the claim's operation id, then writes the payment and completes
//! the idempotency record in one transaction. See the README for a tour.

mod bank;
mod config;
mod db;
mod grpc;
mod http;
mod messaging;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use idem_cache::ReplayCache;
use idem_core::{sweep_all, Store};
use idem_redis::{RedisConfig, RedisStore, TieredStore};
use tracing::{error, info, warn};

use crate::config::{Config, IdemStore};

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHOP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn")),
        )
        .init();
    let config = Config::parse();
    match run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            eprintln!("shop: {e}");
            let mut source = std::error::Error::source(&*e);
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> Result<(), Box<dyn std::error::Error>> {
    config.check()?;
    let policy = config.policy()?;
    // Prometheus text format from the `metrics` facade: the library crates
    // only emit through the facade (no exporter dependency for users), and
    // the application picks the exporter.
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("idem_store_seconds".into()),
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ],
        )
        .map_err(|e| format!("cannot configure the metrics buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    // Histogram samples pile up in the recorder until upkeep folds them into
    // their buckets: without this, memory grows with every request between
    // scrapes (found by the benchmark's steady-load memory run).
    let upkeep = {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                metrics.run_upkeep();
            }
        })
    };
    let database = db::open(
        &config.database_url,
        config.statement_timeout(),
        config.db_connections,
        config.sqlite_synchronous.unwrap_or_default(),
    )
    .await?;
    let kind = database.kind();
    if kind == "postgres" {
        check_replication(&*database, &config).await?;
    }
    let bank = bank::Bank::open(&database, &config.database_url).await?;
    let mut store: Arc<dyn Store> = database.idem_store();
    let redis = match &config.redis_url {
        Some(url) => {
            let redis = if config.redis_cluster {
                RedisConfig::cluster(url.split(',').map(str::trim))
            } else {
                RedisConfig::new(url)
            }
            .wait_replicas(
                config.redis_wait_replicas,
                Duration::from_millis(config.redis_wait_timeout_ms),
            );
            Some(
                RedisStore::connect(redis.prefix(&config.redis_prefix))
                    .await
                    .map_err(|e| format!("cannot connect to Redis at {url}: {e}"))?,
            )
        }
        None => None,
    };
    let transactional = config.idem_store == IdemStore::Database;
    let redis_alone = redis.clone().filter(|_| !transactional);
    match (transactional, redis) {
        (true, Some(redis)) => {
            info!(prefix = %config.redis_prefix, "Redis in front of the database");
            store = Arc::new(TieredStore::new(store, redis));
        }
        (true, None) => {}
        (false, Some(redis)) => {
            info!(prefix = %config.redis_prefix, "idempotency records in Redis alone");
            store = Arc::new(redis);
        }
        (false, None) => return Err("--idem-store redis needs --redis-url".into()),
    }
    if config.replay_cache > 0 {
        store = Arc::new(ReplayCache::new(
            store,
            config.replay_cache,
            64 * 1024 * 1024,
        ));
    }

    let sweeper = tokio::spawn(sweep_forever(
        store.clone(),
        policy.retention(),
        database.clone(),
    ));

    let messaging = Arc::new(
        messaging::Messaging::start(
            database.clone(),
            config.broker_url.as_deref(),
            &config.broker_prefix,
            Duration::from_secs(config.outbox_max_lag_secs),
            std::num::NonZeroUsize::new(usize::from(config.consumer_concurrency))
                .unwrap_or(std::num::NonZeroUsize::MIN),
        )
        .await?,
    );
    if config.webhook_secret.is_none() && config.fault_injection == config::FaultInjection::Off {
        warn!("--fault-injection off without --webhook-secret: POST /webhooks/bank takes unsigned events, so anyone can settle a payment; set a secret before exposing shop");
    }
    let state = http::AppState::new(http::Shared {
        db: database,
        bank,
        messaging: messaging.clone(),
        transactional,
        records: store.clone(),
        retention: policy.retention(),
        lease: policy.lease(),
        redis_alone,
        claim_in_transaction: config.claim_in_transaction,
        claim_tx_slots: Arc::new(tokio::sync::Semaphore::new(
            usize::try_from(config.claim_tx_limit).unwrap_or(8),
        )),
        claim_tx_wait: Duration::from_millis(config.claim_tx_wait_ms),
        fault_injection: config.fault_injection,
        webhook_secret: config
            .webhook_secret
            .as_ref()
            .map(|s| Arc::from(s.as_bytes())),
        metrics,
    });
    let grpc_listener = match &config.grpc_listen {
        Some(at) => Some(
            tokio::net::TcpListener::bind(at)
                .await
                .map_err(|e| format!("cannot listen for gRPC on {at}: {e}"))?,
        ),
        None => None,
    };
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let stopped = |mut stopping: tokio::sync::watch::Receiver<bool>| async move {
        // An error means the sender is gone: stop as well.
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    let limits = idem_axum::serve::Limits {
        header_timeout: Duration::from_secs(config.header_timeout_secs),
        body_timeout: Duration::from_secs(config.body_timeout_secs),
        body_min_rate: config.body_min_rate,
        max_connections: usize::try_from(config.max_connections).unwrap_or(usize::MAX),
        grace: Duration::from_secs(config.shutdown_grace_secs),
    };
    let grpc = match grpc_listener {
        Some(listener) => {
            let addr = listener.local_addr()?;
            let serving = grpc::serve(
                listener,
                state.clone(),
                store.clone(),
                policy.clone(),
                limits,
                stopped(stopping.clone()),
            );
            // Tests and scripts read this line to learn the port.
            println!("shop gRPC listening on http://{addr}");
            Some(tokio::spawn(serving))
        }
        None => None,
    };
    let app = http::router(state, store, policy);
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    // Every problem's `type` names a section of this service's own page.
    let public = config
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));
    idem_axum::problem::set_problem_type_base(format!(
        "{}/problems#",
        public.trim_end_matches('/')
    ))
    .map_err(|e| format!("--public-url: {e}"))?;
    info!(%addr, database = kind, "shop is ready");
    // Tests and scripts read this line to learn the port (with --listen …:0).
    println!("shop listening on http://{addr}");

    // When the stop came: every wait of the shutdown ends within one grace
    // from it, the HTTP server's, the gRPC server's and the handlers' alike.
    let stopped_at = Arc::new(std::sync::OnceLock::new());
    {
        let stopped_at = stopped_at.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            let _ = stopped_at.set(tokio::time::Instant::now());
            let _ = stop.send(true);
        });
    }
    idem_axum::serve::serve(listener, app, limits, stopped(stopping)).await;
    let deadline = stopped_at
        .get()
        .copied()
        .unwrap_or_else(tokio::time::Instant::now)
        + limits.grace;
    if let Some(mut grpc) = grpc {
        // It drains beside the HTTP server, within the same grace; calls
        // still open after it (a stalled client) are cut, as over HTTP.
        match tokio::time::timeout_at(deadline, &mut grpc).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => warn!(error = %e, "the gRPC server failed"),
            Ok(Err(e)) => warn!(error = %e, "the gRPC server's task failed"),
            Err(_) => {
                warn!("gRPC calls still open after the shutdown grace: cut");
                grpc.abort();
            }
        }
        // Then the handlers whose callers went away, which run on tasks of
        // their own, their answers still to be stored (the HTTP server
        // waited for those that had begun before it returned).
        if tokio::time::timeout_at(deadline, idem_once::detached::idle())
            .await
            .is_err()
        {
            warn!(
                handlers = idem_once::detached::running(),
                "handlers still running after the shutdown grace: cut"
            );
        }
    }
    sweeper.abort();
    upkeep.abort();
    // In-flight messages finish and are acknowledged before the consumers stop.
    messaging.shutdown().await;
    info!("shop stopped");
    Ok(())
}

/// Removes idempotency records past their retention, processed message
/// ids past the inbox's (7 days) and sent outbox rows past a day, in
/// bounded batches, forever.
async fn sweep_forever(store: Arc<dyn Store>, retention: Duration, db: db::Database) {
    let every = (retention / 2).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        match sweep_all(&*store, 500).await {
            Ok(0) => {}
            Ok(n) => {
                metrics::counter!("idem_records_swept_total").increment(n);
                info!(swept = n, "removed expired idempotency records")
            }
            Err(e) => warn!(error = %e, "sweep failed; will try again"),
        }
        // Processed message ids past the inbox's retention, and sent events
        // kept a day (for `idem outbox` and for looking into a consumer's
        // complaint): a few batches a tick each, so a backlog drains
        // without holding the writer long, and the sweep keeps up with a
        // consumer's rate rather than one batch a minute.
        let inbox = idem_outbox::inbox::DEFAULT_RETENTION;
        let swept = sweep_batches("inbox", || db.sweep_inbox(inbox)).await;
        if swept > 0 {
            info!(swept, "removed old processed message ids");
        }
        let swept = sweep_batches("outbox", || db.sweep_outbox(OUTBOX_KEEP_SENT)).await;
        metrics::counter!("shop_outbox_swept_total").increment(swept);
        // Payment keys bound with Redis alone, once their records are gone.
        sweep_batches("payment keys", || db::sweep_payment_keys(&*db, retention)).await;
    }
}

/// Runs `sweep` (one batch of at most `db::SWEEP_BATCH` rows) until a batch
/// comes back short, at most `SWEEP_BATCHES` times; how many rows went.
async fn sweep_batches<'a>(
    what: &str,
    mut sweep: impl FnMut() -> idem_core::BoxFuture<'a, Result<u64, sqlx::Error>>,
) -> u64 {
    let mut swept = 0;
    for _ in 0..SWEEP_BATCHES {
        match sweep().await {
            Ok(n) => {
                swept += n;
                if n < db::SWEEP_BATCH.unsigned_abs() {
                    break;
                }
            }
            Err(e) => {
                warn!(error = %e, what, "sweep failed; will try again");
                break;
            }
        }
    }
    swept
}

/// How long sent outbox rows are kept before the sweep deletes them.
const OUTBOX_KEEP_SENT: Duration = Duration::from_secs(24 * 3600);
/// At most this many batches of rows (processed message ids, sent outbox
/// rows) deleted per sweep tick.
const SWEEP_BATCHES: usize = 20;

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    info!("shutting down gracefully");
}

/// Whether the PostgreSQL primary shop writes to has a standby a failover
/// could lose acknowledged commits to: one that is not synchronous, or
/// commits acknowledged before any standby has them (`synchronous_commit`
/// `off` or `local`). With `--claim-in-transaction` shop refuses to start
/// then (unless `--allow-async-standby`); in the other modes it warns.
/// Read once at start (`pg_stat_replication` needs a superuser or
/// `pg_monitor` to show `sync_state`); a standby attached later is not seen.
async fn check_replication(
    database: &dyn db::ShopDb,
    config: &Config,
) -> Result<(), Box<dyn std::error::Error>> {
    let rows = db::query(
        database,
        "SELECT CAST(count(*) AS BIGINT) AS standbys,
                CAST(count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) AS BIGINT) AS synchronous,
                CAST(count(*) FILTER (WHERE sync_state IS NULL) AS BIGINT) AS hidden,
                current_setting('synchronous_commit') AS commit_level
         FROM pg_stat_replication",
        &[],
    )
    .await?;
    let Some(row) = rows.first() else {
        return Ok(());
    };
    let standbys = row.int("standbys")?;
    let synchronous = row.int("synchronous")?;
    let level = row.text("commit_level")?;
    let unsafe_level = matches!(level.as_str(), "off" | "local");
    if standbys == 0 || (synchronous > 0 && !unsafe_level) {
        return Ok(());
    }
    if row.int("hidden")? > 0 {
        // Without superuser or pg_monitor, pg_stat_replication hides how
        // each standby replicates: say so rather than guess.
        warn!(
            standbys,
            "the PostgreSQL primary has standbys whose replication this role cannot see (grant it pg_monitor): \
             a failover to an asynchronous standby can lose answered records"
        );
        return Ok(());
    }
    let why = format!(
        "the PostgreSQL primary has {standbys} standby(s), {synchronous} synchronous, and synchronous_commit = {level}: \
         a failover can lose commits that were acknowledged, and with them idempotency records whose answers were sent \
         (their keys then run again). Name the standby in synchronous_standby_names with synchronous_commit = on or remote_apply"
    );
    if config.claim_in_transaction && !config.allow_async_standby {
        return Err(format!(
            "refusing --claim-in-transaction: {why} (or pass --allow-async-standby)"
        )
        .into());
    }
    warn!("{why}");
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Batches go on while they come back full, up to the cap a tick.
    #[tokio::test]
    async fn a_sweep_goes_on_while_its_batches_are_full() {
        let full = db::SWEEP_BATCH.unsigned_abs();
        let mut answers = vec![full, full, 7].into_iter();
        let mut calls = 0;
        let swept = sweep_batches("test", || {
            calls += 1;
            let n = answers.next().unwrap();
            Box::pin(async move { Ok(n) })
        })
        .await;
        assert_eq!((swept, calls), (2 * full + 7, 3));
        let mut calls = 0;
        let swept = sweep_batches("test", || {
            calls += 1;
            Box::pin(async move { Ok(full) })
        })
        .await;
        assert_eq!((swept, calls), (full * SWEEP_BATCHES as u64, SWEEP_BATCHES));
        let swept = sweep_batches("test", || {
            Box::pin(async { Err(sqlx::Error::PoolTimedOut) })
        })
        .await;
        assert_eq!(swept, 0);
    }
}
