//! The history checker: many clients with retries, short client timeouts,
//! retries with another body under the same key, keys reused after a short
//! retention, bank failures, slow banks past the lease, simulated crashes
//! after the bank call and `kill -9` of real `shop` processes, against two
//! `shop` processes in each of the five modes, and Redis alone on a Redis
//! Cluster. Every request and answer is
//! recorded; then the history must show, per key:
//!
//! - one effect: every payment the database holds was answered to a client,
//!   and every bank charge has its payment (one per operation id);
//! - every `201` for a key (within one retention period) byte-equal to the
//!   first, and for one request body only (no `201` for a reused key with
//!   another body); no error answer replayed;
//! - every key settled: after its faults, retried without them, it is
//!   answered `201` within its retention (no key stuck in flight);
//! - a key reused after its retention: a new payment.
//!
//! Bounded: `IDEM_HISTORY_SECS` (25 by default) of load per mode, the five
//! modes side by side; `IDEM_HISTORY_SEED` replays a run. `bash
//! scripts/history 300` runs longer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fleet::Fleet;
use common::netns::Netns;
use common::pgpair::{PgPair, Replication};
use common::{host_port, redis_url, via, Db, Mode, Rng, Route};
use idem_test_support::faults::{Fault, FaultProxy};

const LEASE_MS: u64 = 1500;
const TTL_SECS: u64 = 12;
/// How long a key is retried with faults injected, before it is settled.
const CHAOS_MS: u64 = 4000;
const CLIENTS: usize = 10;
const PROCESSES: usize = 2;
const ACCOUNT: &str = "acc-history";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    /// The request the client means.
    Main,
    /// Another body under the same key (a buggy or malicious client).
    Other,
}

#[derive(Debug, Clone)]
enum Outcome {
    Answered {
        status: u16,
        replayed: bool,
        body: Vec<u8>,
    },
    /// A transport error: time-out, refused, reset (a killed process).
    Failed,
}

#[derive(Debug, Clone)]
struct Attempt {
    key: String,
    epoch: u32,
    variant: Variant,
    /// The amount in the body this attempt sent.
    amount: u64,
    simulate: Option<String>,
    outcome: Outcome,
    /// When it was sent.
    sent: Instant,
    /// When it was answered (or failed).
    at: Instant,
}

impl Attempt {
    fn status(&self) -> Option<u16> {
        match self.outcome {
            Outcome::Answered { status, .. } => Some(status),
            Outcome::Failed => None,
        }
    }
}

fn body(amount: u64) -> String {
    format!(r#"{{"account_id":"{ACCOUNT}","amount":{amount},"currency":"EUR"}}"#)
}

/// One client's view of a key: its two bodies.
#[derive(Clone)]
struct Intent {
    key: String,
    epoch: u32,
    amount: u64,
    main: String,
    other: String,
}

impl Intent {
    fn amount(&self, v: Variant) -> u64 {
        match v {
            Variant::Main => self.amount,
            Variant::Other => self.amount + 1,
        }
    }

    fn body(&self, v: Variant) -> &str {
        match v {
            Variant::Main => &self.main,
            Variant::Other => &self.other,
        }
    }
}

struct Shared {
    fleet: Arc<Fleet>,
    http: reqwest::Client,
    log: Mutex<Vec<Attempt>>,
    /// Keys whose last session ended with an answer, to reuse after their
    /// retention: (due, key, next epoch).
    reuse: Mutex<Vec<(Instant, String, u32)>>,
    /// Keys that were never answered `201`: stuck (key, epoch).
    unsettled: Mutex<Vec<(String, u32)>>,
    /// When the run began, and the faults injected since (for the story of
    /// a key that went wrong).
    started: Instant,
    faults: Mutex<Vec<String>>,
    crashes: bool,
}

async fn send(
    shared: &Shared,
    rng: &mut Rng,
    intent: &Intent,
    variant: Variant,
    simulate: Option<String>,
    timeout: Duration,
) -> Attempt {
    let sent = Instant::now();
    let outcome = match shared.fleet.base(rng.next()) {
        None => Outcome::Failed,
        Some(base) => {
            let mut r = shared
                .http
                .post(format!("{base}/payments"))
                .header("authorization", "Bearer history")
                .header("content-type", "application/json")
                .header("idempotency-key", &intent.key)
                .timeout(timeout)
                .body(intent.body(variant).to_owned());
            if let Some(s) = &simulate {
                r = r.header("x-simulate", s);
            }
            match r.send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let replayed = resp
                        .headers()
                        .get("idempotent-replayed")
                        .is_some_and(|v| v == "true");
                    match resp.bytes().await {
                        Ok(b) => Outcome::Answered {
                            status,
                            replayed,
                            body: b.to_vec(),
                        },
                        Err(_) => Outcome::Failed,
                    }
                }
                Err(_) => Outcome::Failed,
            }
        }
    };
    let attempt = Attempt {
        key: intent.key.clone(),
        epoch: intent.epoch,
        variant,
        amount: intent.amount(variant),
        simulate,
        outcome,
        sent,
        at: Instant::now(),
    };
    shared.log.lock().unwrap().push(attempt.clone());
    attempt
}

/// After a failover: every key answered `201` since `since` is asked
/// again, as a client whose answer was lost would; each must replay the
/// first answer (what the failover kept), or the checker says what it lost.
/// Only within the key's retention: after it, the same key is a new
/// request, rightly (a failover slowed by a busy machine can outlast it).
async fn ask_again(shared: &Shared, since: Instant) {
    let answered: Vec<(Attempt, Instant)> = {
        let log = shared.log.lock().unwrap();
        // When each key was first sent: its retention ends no sooner than
        // that, plus the retention.
        let mut first: BTreeMap<(&str, u32), Instant> = BTreeMap::new();
        for a in log.iter() {
            first.entry((&a.key, a.epoch)).or_insert(a.sent);
        }
        let mut seen = BTreeSet::new();
        log.iter()
            .filter(|a| a.at >= since && a.status() == Some(201))
            .filter(|a| seen.insert((a.key.clone(), a.epoch)))
            .map(|a| {
                let retained = first[&(a.key.as_str(), a.epoch)]
                    + Duration::from_millis(TTL_SECS * 1000 - 1000);
                (a.clone(), retained)
            })
            .collect()
    };
    let mut rng = Rng::new(0x5eed);
    let deadline = Instant::now() + Duration::from_secs(8);
    for (a, retained) in answered {
        if Instant::now() > deadline {
            break;
        }
        let intent = Intent {
            key: a.key.clone(),
            epoch: a.epoch,
            amount: match a.variant {
                Variant::Main => a.amount,
                Variant::Other => a.amount - 1,
            },
            main: String::new(),
            other: String::new(),
        };
        let intent = Intent {
            main: body(intent.amount),
            other: body(intent.amount + 1),
            ..intent
        };
        // Retried until answered: the new primary may still be settling.
        loop {
            let now = Instant::now();
            if now >= deadline.min(retained) {
                break;
            }
            let timeout = Duration::from_secs(5).min(retained - now);
            let again = send(shared, &mut rng, &intent, a.variant, None, timeout).await;
            if matches!(again.status(), Some(201 | 422)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

fn simulate(rng: &mut Rng, crashes: bool) -> Option<String> {
    match rng.below(100) {
        0..=54 => None,
        55..=79 => Some(format!("bank-delay={}", rng.between(50, 1200))),
        80..=87 => Some("bank-error".to_owned()),
        // Slower than the lease: a retry takes over while this one runs.
        88..=94 => Some(format!("bank-delay={}", rng.between(1600, 2600))),
        _ if crashes => Some("crash-after-bank".to_owned()),
        _ => None,
    }
}

/// One client: sessions of retries, each until its request is answered.
async fn client(shared: Arc<Shared>, id: usize, seed: u64, until: Instant) {
    let mut rng = Rng::new(seed);
    let mut n = 0;
    while Instant::now() < until {
        let due = {
            let mut reuse = shared.reuse.lock().unwrap();
            let now = Instant::now();
            reuse
                .iter()
                .position(|(at, _, _)| *at <= now)
                .map(|i| reuse.swap_remove(i))
        };
        let (key, epoch) = match due {
            Some((_, key, epoch)) => (key, epoch),
            None => {
                n += 1;
                (format!("h{id}-{n}-{seed:x}"), 0)
            }
        };
        let amount = rng.between(100, 99_999);
        let intent = Intent {
            key: key.clone(),
            epoch,
            amount,
            main: body(amount),
            other: body(amount + 1),
        };
        let started = Instant::now();
        // Settled (answered 201) well within the retention, or the key is
        // stuck: after it, the same key is a new request.
        let settle_by = started + Duration::from_millis(TTL_SECS * 1000 - 1000);
        let mut sent_other = false;
        let mut answered = false;
        // After a 422, the other body holds the key: ask with it.
        let mut prefer: Option<Variant> = None;
        loop {
            let now = Instant::now();
            if now >= settle_by {
                shared.unsettled.lock().unwrap().push((key.clone(), epoch));
                break;
            }
            let chaos = now < started + Duration::from_millis(CHAOS_MS);
            let variant = match prefer {
                Some(v) => v,
                None if chaos && !sent_other && rng.percent(8) => {
                    sent_other = true;
                    Variant::Other
                }
                None => Variant::Main,
            };
            let (sim, timeout) = if chaos {
                (
                    simulate(&mut rng, shared.crashes),
                    Duration::from_millis(rng.between(300, 2000)),
                )
            } else {
                (None, Duration::from_millis(5000))
            };
            let timeout = timeout.min(settle_by - now);
            let a = send(&shared, &mut rng, &intent, variant, sim, timeout).await;
            match a.status() {
                Some(201) => {
                    answered = true;
                    break;
                }
                Some(422) => {
                    prefer = Some(match variant {
                        Variant::Main => Variant::Other,
                        Variant::Other => Variant::Main,
                    })
                }
                Some(409) => tokio::time::sleep(Duration::from_millis(rng.between(100, 400))).await,
                _ => tokio::time::sleep(Duration::from_millis(rng.between(20, 200))).await,
            }
        }
        if answered {
            // A few duplicates after the answer: replays, and another body.
            for _ in 0..rng.below(3) {
                let v = if rng.percent(30) {
                    Variant::Other
                } else {
                    Variant::Main
                };
                send(
                    &shared,
                    &mut rng,
                    &intent,
                    v,
                    None,
                    Duration::from_millis(2000),
                )
                .await;
            }
            if rng.percent(15) {
                let at = Instant::now() + Duration::from_millis(TTL_SECS * 1000 + 1500);
                shared.reuse.lock().unwrap().push((at, key, epoch + 1));
            }
        }
    }
}

/// What happened to one key, attempt by attempt, in seconds since the run
/// began: for the message of a key that went wrong.
fn story(log: &[Attempt], started: Instant, key: &str, epoch: u32) -> String {
    let steps: Vec<String> = log
        .iter()
        .filter(|a| a.key == key && a.epoch == epoch)
        .map(|a| {
            let answer = match &a.outcome {
                Outcome::Answered {
                    status,
                    body,
                    replayed,
                } => {
                    // A problem's type, or a payment's id.
                    let v = serde_json::from_slice::<serde_json::Value>(body).ok();
                    let what = v
                        .as_ref()
                        .and_then(|v| v["type"].as_str().or(v["id"].as_str()))
                        .unwrap_or_default();
                    let replayed = if *replayed { " (replayed)" } else { "" };
                    format!("{status} {what}{replayed}")
                }
                Outcome::Failed => "no answer".to_owned(),
            };
            format!(
                "{:.1}–{:.1} s {:?}{} → {answer}",
                (a.sent - started).as_secs_f64(),
                (a.at - started).as_secs_f64(),
                a.variant,
                a.simulate
                    .as_deref()
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default()
            )
        })
        .collect();
    steps.join("; ")
}

fn payment_id(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v["id"].as_str().map(str::to_owned)
}

/// What the database holds: payment ids, bank charges without a payment (or
/// whose payment differs from what the bank charged), and all charges.
async fn database(db: &Db) -> (BTreeSet<String>, i64, i64) {
    const PAYMENTS: &str = "SELECT id FROM shop_payments";
    const ORPHANS: &str = "SELECT count(*) FROM bank_charges b
        WHERE NOT EXISTS (SELECT 1 FROM shop_payments p WHERE p.operation_id = b.operation_id
                          AND p.amount = b.amount AND p.account_id = b.account_id)";
    const CHARGES: &str = "SELECT count(*) FROM bank_charges";
    match db {
        Db::Sqlite(..) => {
            let pool = sqlx::SqlitePool::connect(&db.url()).await.unwrap();
            let ids: Vec<String> = sqlx::query_scalar(PAYMENTS).fetch_all(&pool).await.unwrap();
            let orphans = sqlx::query_scalar(ORPHANS).fetch_one(&pool).await.unwrap();
            let charges = sqlx::query_scalar(CHARGES).fetch_one(&pool).await.unwrap();
            pool.close().await;
            (ids.into_iter().collect(), orphans, charges)
        }
        Db::Postgres(_) | Db::PostgresAt(_) => {
            let pool = sqlx::PgPool::connect(&db.url()).await.unwrap();
            let ids: Vec<String> = sqlx::query_scalar(PAYMENTS).fetch_all(&pool).await.unwrap();
            let orphans = sqlx::query_scalar(ORPHANS).fetch_one(&pool).await.unwrap();
            let charges = sqlx::query_scalar(CHARGES).fetch_one(&pool).await.unwrap();
            pool.close().await;
            (ids.into_iter().collect(), orphans, charges)
        }
        Db::Mysql(_) => {
            let pool = sqlx::MySqlPool::connect(&db.url()).await.unwrap();
            let ids: Vec<Vec<u8>> = sqlx::query_scalar(PAYMENTS).fetch_all(&pool).await.unwrap();
            let orphans = sqlx::query_scalar(ORPHANS).fetch_one(&pool).await.unwrap();
            let charges = sqlx::query_scalar(CHARGES).fetch_one(&pool).await.unwrap();
            pool.close().await;
            let ids = ids.into_iter().map(|id| String::from_utf8(id).unwrap());
            (ids.collect(), orphans, charges)
        }
    }
}

/// Checks the recorded history against the promises; returns violations.
fn check(
    log: &[Attempt],
    started: Instant,
    db_payments: &BTreeSet<String>,
    orphans: i64,
    charges: i64,
) -> Vec<String> {
    let mut violations = Vec::new();
    let mut by_key: BTreeMap<(&str, u32), Vec<&Attempt>> = BTreeMap::new();
    for a in log {
        by_key.entry((&a.key, a.epoch)).or_default().push(a);
    }
    let mut answered_ids = BTreeSet::new();
    let mut first_payment: BTreeMap<&str, BTreeMap<u32, String>> = BTreeMap::new();
    for ((key, epoch), attempts) in &by_key {
        let created: Vec<(&Attempt, &Vec<u8>)> = attempts
            .iter()
            .filter_map(|a| match &a.outcome {
                Outcome::Answered {
                    status: 201, body, ..
                } => Some((*a, body)),
                _ => None,
            })
            .collect();
        for (a, b) in &created {
            let answered = serde_json::from_slice::<serde_json::Value>(b)
                .ok()
                .and_then(|v| v["amount"].as_u64());
            if answered != Some(a.amount) {
                violations.push(format!(
                    "{key} (epoch {epoch}): a request for {} was answered 201 for {answered:?}",
                    a.amount
                ));
            }
        }
        if let Some((_, first)) = created.first() {
            for (a, b) in &created {
                if b != first {
                    violations.push(format!(
                        "{key} (epoch {epoch}): a 201 differs from the first ({:?} vs {:?}): {}",
                        String::from_utf8_lossy(b),
                        String::from_utf8_lossy(first),
                        story(log, started, key, *epoch)
                    ));
                }
                if a.variant != created[0].0.variant {
                    violations.push(format!(
                        "{key} (epoch {epoch}): 201 for two different bodies under one key"
                    ));
                }
            }
            match payment_id(first) {
                Some(id) => {
                    answered_ids.insert(id.clone());
                    first_payment.entry(key).or_default().insert(*epoch, id);
                }
                None => violations.push(format!("{key}: a 201 without a payment id")),
            }
        }
        for a in attempts {
            match &a.outcome {
                Outcome::Answered {
                    status,
                    replayed,
                    body,
                } => {
                    let allowed = match status {
                        201 | 409 | 422 | 502 | 503 => true,
                        // 409s and 422s replayed would be stored errors.
                        _ => false,
                    };
                    if !allowed || (*replayed && *status != 201) {
                        violations.push(format!(
                            "{key} (epoch {epoch}): unexpected {status} (replayed: {replayed}, simulate {:?}): {}",
                            a.simulate,
                            String::from_utf8_lossy(body)
                        ));
                    }
                    if *status == 502 && a.simulate.as_deref() != Some("bank-error") {
                        violations.push(format!(
                            "{key} (epoch {epoch}): 502 without a bank failure: {}",
                            String::from_utf8_lossy(body)
                        ));
                    }
                }
                Outcome::Failed => {}
            }
        }
    }
    for (key, epochs) in &first_payment {
        let ids: BTreeSet<&String> = epochs.values().collect();
        if ids.len() != epochs.len() {
            violations.push(format!(
                "{key}: reused after its retention, yet answered with an old payment"
            ));
        }
    }
    for id in db_payments.difference(&answered_ids) {
        violations.push(format!(
            "payment {id} was made but never answered (a double effect)"
        ));
    }
    for id in answered_ids.difference(db_payments) {
        violations.push(format!(
            "payment {id} was answered but is not in the database"
        ));
    }
    if orphans != 0 {
        violations.push(format!(
            "{orphans} bank charges have no payment for the same amount"
        ));
    }
    if charges != db_payments.len() as i64 {
        violations.push(format!(
            "{charges} bank charges for {} payments",
            db_payments.len()
        ));
    }
    violations
}

/// What goes wrong during a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chaos {
    /// `kill -9` of shop processes, crashes after the bank call.
    Crashes,
    /// The network between shop and its database (and Redis): latency with
    /// jitter, partitions that heal, connections cut.
    Network,
    /// PostgreSQL fails over: the standby is held back from the primary for
    /// a second, the primary crashes, the standby is promoted and the
    /// service's address moves to it.
    Failover(Replication),
    /// Redis alone fails over the same way (as Sentinel would): its replica
    /// held back a second, the primary killed, the replica promoted
    /// (`REPLICAOF NO ONE`), the address moved, the replica's own chained
    /// replica there to acknowledge; with or without
    /// `--redis-wait-replicas 1`.
    RedisFailover {
        /// `--redis-wait-replicas 1`.
        wait: bool,
    },
    /// A Redis Cluster of three primaries with a replica each: a primary's
    /// replica held back a second, the primary killed mid-run, its replica
    /// promoted by the cluster, the killed node back (empty) as a replica
    /// once the replica acts as primary; with or without
    /// `--redis-wait-replicas 1`.
    ClusterFailover {
        /// `--redis-wait-replicas 1`.
        wait: bool,
    },
}

/// A Redis primary and its replica, the replica's link to the primary
/// through a fault proxy, a second replica chained to the first (as a
/// Sentinel setup keeps a spare replica), and the address the service
/// reaches Redis by.
struct RedisPair {
    primary: std::sync::Mutex<common::OwnRedis>,
    replica: common::OwnRedis,
    /// The first replica's own replica: once that one is promoted, claims
    /// that wait for a replica have one at once, however long restarting
    /// the killed primary would take on a busy machine.
    _chained: common::OwnRedis,
    replication: FaultProxy,
    address: FaultProxy,
}

impl RedisPair {
    async fn start() -> RedisPair {
        let primary = common::OwnRedis::start();
        let at = format!("127.0.0.1:{}", primary.port);
        let replication = FaultProxy::start(&at).await;
        let replica = common::OwnRedis::replica_of(&replication.addr().to_string());
        primary.wait_replicas_online(1);
        let chained = common::OwnRedis::replica_of(&format!("127.0.0.1:{}", replica.port));
        replica.wait_replicas_online(1);
        let address = FaultProxy::start(&at).await;
        RedisPair {
            primary: std::sync::Mutex::new(primary),
            replica,
            _chained: chained,
            replication,
            address,
        }
    }

    fn fail_over(&self) {
        let mut old = self.primary.lock().unwrap();
        old.stop();
        let promoted = self.replica.cli(&["REPLICAOF", "NO", "ONE"]);
        assert!(promoted.contains("OK"), "{promoted}");
        self.address
            .set_upstream(&format!("127.0.0.1:{}", self.replica.port));
        self.address.cut();
        // Its chained replica stays (reconnected after the promotion, a
        // partial resync): claims waiting for a replica have one again.
        self.replica.wait_replicas_online(1);
    }
}

/// The faults injected on the links, by kind.
#[derive(Debug, Default)]
struct Injected {
    delays: u64,
    /// Packets dropped at random on the servers' link (by the kernel).
    losses: u64,
    partitions: u64,
    /// Of the partitions, those made by taking the veth link down.
    link_downs: u64,
    cuts: u64,
}

/// The links between the fleet and its servers: fault proxies, and (for
/// network faults) the veth link of the namespace the fleet runs in.
struct Links {
    database: FaultProxy,
    redis: Option<FaultProxy>,
    netns: Option<Arc<Netns>>,
}

impl Links {
    /// The fleet in a network namespace of its own, reaching its servers
    /// through fault proxies on the host's end of its veth link.
    async fn start(mode: Mode, db: &Db) -> (Links, Route) {
        let netns = Arc::new(Netns::create());
        let bind = netns.servers_host_ip.clone();
        let database = FaultProxy::start_on(&bind, &host_port(&db.url())).await;
        let redis = match mode {
            Mode::Tiered | Mode::RedisAlone => {
                Some(FaultProxy::start_on(&bind, &host_port(&redis_url())).await)
            }
            _ => None,
        };
        let route = Route {
            database_url: via(&db.url(), database.addr()),
            redis_url: redis
                .as_ref()
                .map_or_else(redis_url, |r| via(&redis_url(), r.addr())),
            netns: Some(netns.clone()),
        };
        (
            Links {
                database,
                redis,
                netns: Some(netns),
            },
            route,
        )
    }

    /// One fault on one link, for a while; then the link heals. Says which.
    async fn inject(&self, rng: &mut Rng, injected: &mut Injected) -> String {
        let (link, name) = match &self.redis {
            Some(redis) if rng.percent(40) => (redis, "Redis"),
            _ => (&self.database, "the database"),
        };
        let what = match rng.below(100) {
            0..=14 if self.netns.is_some() => {
                // 5–30 % of the packets lost, each way, on every server's
                // link at once: TCP retransmits, round trips stretch to
                // one or several retransmission time-outs (200 ms up).
                injected.losses += 1;
                let ns = self.netns.as_ref().unwrap();
                let percent = rng.between(5, 30);
                ns.lose(u8::try_from(percent).unwrap());
                tokio::time::sleep(Duration::from_millis(rng.between(500, 2500))).await;
                ns.stop_losing();
                format!("{percent} % of packets lost on every link")
            }
            0..=39 => {
                injected.delays += 1;
                let base = rng.between(5, 150);
                let jitter = rng.between(0, 100);
                link.set(Fault::Delay {
                    base: Duration::from_millis(base),
                    jitter: Duration::from_millis(jitter),
                });
                tokio::time::sleep(Duration::from_millis(rng.between(500, 2500))).await;
                format!("{name} delayed {base} ms ± {jitter} ms")
            }
            40..=74 => {
                // Some shorter than the statement time-out, some longer;
                // half made by the kernel (the veth link down: every
                // server at once), half by a proxy (one server).
                injected.partitions += 1;
                let pause = Duration::from_millis(rng.between(300, 3000));
                match &self.netns {
                    Some(ns) if rng.percent(50) => {
                        injected.link_downs += 1;
                        ns.partition();
                        tokio::time::sleep(pause).await;
                        ns.heal();
                        "every link down (a partition by the kernel)".to_owned()
                    }
                    _ => {
                        link.set(Fault::Partition);
                        tokio::time::sleep(pause).await;
                        format!("{name} partitioned (by its proxy)")
                    }
                }
            }
            _ => {
                injected.cuts += 1;
                link.cut();
                format!("{name}'s connections cut")
            }
        };
        link.set(Fault::None);
        what
    }
}

async fn run(mode: Mode) {
    run_with(mode, Chaos::Crashes).await;
}

async fn run_with(mode: Mode, chaos: Chaos) {
    let secs: u64 = std::env::var(match chaos {
        Chaos::Crashes => "IDEM_HISTORY_SECS",
        Chaos::Network => "IDEM_NETWORK_SECS",
        Chaos::Failover(_) | Chaos::RedisFailover { .. } | Chaos::ClusterFailover { .. } => {
            "IDEM_FAILOVER_SECS"
        }
    })
    .ok()
    .and_then(|s| s.parse().ok())
    .unwrap_or(match chaos {
        Chaos::Crashes => 25,
        Chaos::Network => 20,
        Chaos::Failover(_) | Chaos::RedisFailover { .. } | Chaos::ClusterFailover { .. } => 16,
    });
    let seed = std::env::var("IDEM_HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0);
    let lease = LEASE_MS.to_string();
    let ttl = TTL_SECS.to_string();
    let mut flags = vec!["--lease-ms", &lease, "--ttl-secs", &ttl];
    let mut pair = None;
    let redis_pair = match chaos {
        Chaos::RedisFailover { .. } => {
            assert_eq!(mode, Mode::RedisAlone);
            Some(RedisPair::start().await)
        }
        _ => None,
    };
    let cluster = match chaos {
        Chaos::ClusterFailover { .. } => {
            assert!(matches!(mode, Mode::Tiered | Mode::RedisAlone));
            Some(tokio::sync::Mutex::new(
                tokio::task::spawn_blocking(common::rcluster::OwnCluster::start)
                    .await
                    .unwrap(),
            ))
        }
        _ => None,
    };
    let db = match chaos {
        Chaos::Failover(replication) => {
            assert!(matches!(mode, Mode::Postgres | Mode::ClaimInTx));
            let started = PgPair::start(replication).await;
            // Read back from the standby, the primary after the failover.
            let db = Db::PostgresAt(started.standby_url());
            pair = Some(started);
            db
        }
        _ => mode.db().await,
    };
    let (links, route) = match chaos {
        Chaos::Crashes => (None, Route::direct(&db)),
        Chaos::ClusterFailover { wait } => {
            if wait {
                flags.extend([
                    "--redis-wait-replicas",
                    "1",
                    "--redis-wait-timeout-ms",
                    "200",
                ]);
            }
            flags.extend(["--statement-timeout-ms", "700", "--redis-cluster"]);
            let urls = cluster.as_ref().unwrap().lock().await.urls();
            let route = Route {
                database_url: db.url(),
                redis_url: urls,
                netns: None,
            };
            (None, route)
        }
        Chaos::RedisFailover { wait } => {
            flags.extend(["--statement-timeout-ms", "700"]);
            if wait {
                flags.extend([
                    "--redis-wait-replicas",
                    "1",
                    "--redis-wait-timeout-ms",
                    "200",
                ]);
            }
            let address = redis_pair.as_ref().unwrap().address.addr();
            let route = Route {
                database_url: db.url(),
                redis_url: format!("redis://{address}"),
                netns: None,
            };
            (None, route)
        }
        Chaos::Network => {
            // A statement behind a partition ends within this, well inside
            // the lease.
            flags.extend(["--statement-timeout-ms", "700"]);
            let (links, route) = Links::start(mode, &db).await;
            (Some(links), route)
        }
        Chaos::Failover(_) => {
            // A commit waiting for a held-back synchronous standby ends
            // within this (503), well inside the lease.
            flags.extend(["--statement-timeout-ms", "700"]);
            let pair = pair.as_ref().unwrap();
            // The service's address: moved to the standby when promoted.
            let address = FaultProxy::start(&format!("127.0.0.1:{}", pair.primary_port)).await;
            let route = Route {
                database_url: via(&pair.primary_url(), address.addr()),
                redis_url: redis_url(),
                netns: None,
            };
            (
                Some(Links {
                    database: address,
                    redis: None,
                    netns: None,
                }),
                route,
            )
        }
    };
    let fleet = Fleet::start_routed(mode, db, route, "history", PROCESSES, &flags).await;
    let shared = Arc::new(Shared {
        fleet: fleet.clone(),
        http: reqwest::Client::new(),
        log: Mutex::new(Vec::new()),
        reuse: Mutex::new(Vec::new()),
        unsettled: Mutex::new(Vec::new()),
        started: Instant::now(),
        faults: Mutex::new(Vec::new()),
        crashes: chaos == Chaos::Crashes,
    });
    let until = Instant::now() + Duration::from_secs(secs);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            tokio::spawn(client(
                shared.clone(),
                i,
                seed.wrapping_add(i as u64 * 0x9e37_79b9),
                until,
            ))
        })
        .collect();
    // The chaos: a kill -9 every few seconds (crashed processes
    // restarted), or one network fault after another.
    let mut rng = Rng::new(seed ^ 0xc4a0);
    let mut next_kill = Instant::now() + Duration::from_millis(rng.between(2000, 5000));
    let mut injected = Injected::default();
    let failover_at = Instant::now() + Duration::from_secs(secs) * 2 / 5;
    let mut failed_over = false;
    while Instant::now() < until {
        if let Some(cluster) = &cluster {
            if !failed_over && Instant::now() >= failover_at {
                failed_over = true;
                let since = Instant::now() - Duration::from_secs(2);
                let mut nodes = cluster.lock().await;
                let taken = std::mem::replace(
                    &mut *nodes,
                    common::rcluster::OwnCluster { nodes: Vec::new() },
                );
                let at = shared.started.elapsed().as_secs_f64();
                shared.faults.lock().unwrap().push(format!(
                    "{at:.1} s: a primary's replica held back 1 s, then the primary killed"
                ));
                let mut taken = tokio::task::spawn_blocking(move || {
                    let mut c = taken;
                    c.fail_over_a_primary(true);
                    c
                })
                .await
                .unwrap();
                let at = shared.started.elapsed().as_secs_f64();
                shared.faults.lock().unwrap().push(format!(
                    "{at:.1} s: the replica promoted, the killed node back as its replica"
                ));
                std::mem::swap(&mut *nodes, &mut taken);
                drop(nodes);
                ask_again(&shared, since).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        if let Some(redis) = &redis_pair {
            if !failed_over && Instant::now() >= failover_at {
                failed_over = true;
                let since = Instant::now() - Duration::from_secs(2);
                let note = |what: &str| {
                    let at = shared.started.elapsed().as_secs_f64();
                    shared
                        .faults
                        .lock()
                        .unwrap()
                        .push(format!("{at:.1} s: {what}"));
                };
                note("the replica held back");
                redis.replication.set(Fault::Partition);
                tokio::time::sleep(Duration::from_millis(1000)).await;
                note("the primary killed");
                redis.fail_over();
                note("the replica promoted, the address moved, its chained replica online");
                ask_again(&shared, since).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        match (&links, &pair) {
            (Some(address), Some(pair)) => {
                if !failed_over && Instant::now() >= failover_at {
                    failed_over = true;
                    // The standby falls behind: what commits now is on
                    // the primary alone (asynchronous), or waits for the
                    // standby (synchronous).
                    pair.replication.set(Fault::Partition);
                    tokio::time::sleep(Duration::from_millis(1000)).await;
                    pair.crash_primary();
                    pair.promote_standby();
                    address
                        .database
                        .set_upstream(&format!("127.0.0.1:{}", pair.standby_port));
                    address.database.cut();
                    ask_again(&shared, failover_at - Duration::from_secs(2)).await;
                }
                fleet.tend(None).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (None, _) => {
                let kill = (Instant::now() >= next_kill).then(|| {
                    next_kill = Instant::now() + Duration::from_millis(rng.between(3000, 6000));
                    rng.below(PROCESSES as u64) as usize
                });
                fleet.tend(kill).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (Some(links), None) => {
                let from = shared.started.elapsed();
                let what = links.inject(&mut rng, &mut injected).await;
                let to = shared.started.elapsed();
                shared.faults.lock().unwrap().push(format!(
                    "{:.1}–{:.1} s: {what}",
                    from.as_secs_f64(),
                    to.as_secs_f64()
                ));
                fleet.tend(None).await;
                // Calm between faults, longer than a lease: the promise is
                // that a key settles within a lease after a fault heals
                // (faults back to back for the whole of a key's retention
                // leave it nothing to settle in).
                tokio::time::sleep(Duration::from_millis(
                    rng.between(LEASE_MS + 500, LEASE_MS + 2000),
                ))
                .await;
            }
        }
    }
    for c in clients {
        // Sessions end by themselves (bounded retries); keep tending.
        while !c.is_finished() {
            fleet.tend(None).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        c.await.unwrap();
    }
    let unsettled = shared.unsettled.lock().unwrap().clone();
    let (db_payments, orphans, charges) = database(&fleet.db).await;
    let log = shared.log.lock().unwrap().clone();
    let mut violations = check(&log, shared.started, &db_payments, orphans, charges);
    for (key, epoch) in &unsettled {
        violations.push(format!(
            "{key} (epoch {epoch}): no 201 within the retention ({} s): {}",
            TTL_SECS - 1,
            story(&log, shared.started, key, *epoch)
        ));
    }
    let faults_seen = shared.faults.lock().unwrap().join("; ");
    let keys: BTreeSet<(&str, u32)> = log.iter().map(|a| (a.key.as_str(), a.epoch)).collect();
    let reused = keys.iter().filter(|(_, e)| *e > 0).count();
    let crashes = log
        .iter()
        .filter(|a| a.simulate.as_deref() == Some("crash-after-bank"))
        .count();
    let faults = match chaos {
        Chaos::Crashes => String::new(),
        Chaos::Failover(r) => format!(
            ", the standby held back 1 s, the primary crashed, the standby promoted ({r:?})"
        ),
        Chaos::ClusterFailover { wait } => format!(
            ", a primary of three held back from its replica 1 s and killed, the replica promoted by the cluster (--redis-wait-replicas {})",
            u8::from(wait)
        ),
        Chaos::RedisFailover { wait } => format!(
            ", the replica held back 1 s, the primary killed, the replica promoted (--redis-wait-replicas {})",
            u8::from(wait)
        ),
        Chaos::Network => format!(
            ", network faults: {} delays, {} losses, {} partitions ({} by the kernel), {} cuts",
            injected.delays,
            injected.losses,
            injected.partitions,
            injected.link_downs,
            injected.cuts
        ),
    };
    let summary = format!(
        "history {mode:?} ({chaos:?}{faults}): seed {seed}, {} s, {} keys ({reused} reused after retention), {} requests ({} 201, {} 409, {} 422, {} 5xx, {} no answer), {} kill -9, {} crash-after-bank, {} restarts, {} payments, {} violations",
        secs,
        keys.len(),
        log.len(),
        log.iter().filter(|a| a.status() == Some(201)).count(),
        log.iter().filter(|a| a.status() == Some(409)).count(),
        log.iter().filter(|a| a.status() == Some(422)).count(),
        log.iter().filter(|a| a.status().is_some_and(|s| s >= 500)).count(),
        log.iter().filter(|a| a.status().is_none()).count(),
        *fleet.kills.lock().unwrap(),
        crashes,
        *fleet.restarts.lock().unwrap(),
        db_payments.len(),
        violations.len(),
    );
    println!("{summary}");
    if !faults_seen.is_empty() {
        println!("the faults: {faults_seen}");
    }
    if let Ok(dir) = std::env::var("IDEM_HISTORY_REPORT") {
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(
            format!("{dir}/{mode:?}-{chaos:?}.txt"),
            format!("{summary}\n{}\n", violations.join("\n")),
        );
    }
    if chaos == Chaos::Failover(Replication::Asynchronous) {
        // What asynchronous replication costs, measured: the commits the
        // primary acknowledged while the standby was held back are gone
        // after the failover, so answers were given for payments that no
        // longer exist, and their keys run again as new.
        assert!(
            !violations.is_empty(),
            "{summary}: the asynchronous failover lost nothing; the measurement did not reach the window"
        );
        return;
    }
    if matches!(
        chaos,
        Chaos::RedisFailover { wait: false } | Chaos::ClusterFailover { wait: false }
    ) && mode != Mode::Tiered
    {
        // Redis lost the claims its primary acknowledged while the replica
        // was held back, and their keys ran again under new operation ids;
        // each resumed under the operation its key was bound to in the
        // database, so nothing was charged twice or answered otherwise
        // (asserted below). Before the binding, this window made payments
        // twice.
        let mut resumed = 0;
        for base in fleet.bases() {
            let Ok(r) = shared.http.get(format!("{base}/metrics")).send().await else {
                continue;
            };
            let text = r.text().await.unwrap_or_default();
            resumed += text
                .lines()
                .filter_map(|l| l.strip_prefix("shop_payment_keys_resumed_total "))
                .filter_map(|v| v.trim().parse::<f64>().ok())
                .sum::<f64>() as u64;
        }
        println!("{resumed} keys resumed under their bound operation");
        assert!(
            resumed > 0,
            "{summary}: the failover lost no claim; the measurement did not reach the window"
        );
    }
    // The summary last: a report that keeps only the end of the output
    // (a CI log's tail) still shows what ran and how many went wrong.
    assert!(
        violations.is_empty(),
        "{}\nthe faults: {faults_seen}\n{summary}",
        violations
            .iter()
            .take(30)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    run(Mode::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    run(Mode::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    run(Mode::Mysql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_claim_in_transaction() {
    run(Mode::ClaimInTx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_redis_and_replay_cache() {
    run(Mode::Tiered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone() {
    run(Mode::RedisAlone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone_on_a_redis_cluster() {
    run(Mode::RedisCluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_faults_postgres() {
    run_with(Mode::Postgres, Chaos::Network).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_faults_mysql() {
    run_with(Mode::Mysql, Chaos::Network).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_faults_postgres_claim_in_transaction() {
    run_with(Mode::ClaimInTx, Chaos::Network).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_faults_postgres_with_redis_and_replay_cache() {
    run_with(Mode::Tiered, Chaos::Network).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_faults_redis_alone() {
    run_with(Mode::RedisAlone, Chaos::Network).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_synchronous() {
    run_with(Mode::Postgres, Chaos::Failover(Replication::Synchronous)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_claim_in_transaction_synchronous() {
    run_with(Mode::ClaimInTx, Chaos::Failover(Replication::Synchronous)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_postgres_asynchronous_loses_what_the_standby_had_not_received() {
    run_with(Mode::Postgres, Chaos::Failover(Replication::Asynchronous)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_redis_alone_waiting_for_the_replica() {
    run_with(Mode::RedisAlone, Chaos::RedisFailover { wait: true }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_redis_alone_without_waiting_loses_claims_but_charges_once() {
    run_with(Mode::RedisAlone, Chaos::RedisFailover { wait: false }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_tiered() {
    run_with(Mode::Tiered, Chaos::ClusterFailover { wait: false }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_redis_alone_waiting_for_the_replica() {
    run_with(Mode::RedisAlone, Chaos::ClusterFailover { wait: true }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_redis_alone_without_waiting_loses_claims_but_charges_once() {
    run_with(Mode::RedisAlone, Chaos::ClusterFailover { wait: false }).await;
}
