//! A partition between shop and its store: answers come in bounded time
//! (`--statement-timeout-ms`), `503` with `Retry-After`, never a request
//! that hangs until the network heals; after it heals, the same key is
//! charged once and replayed. Each mode twice: the partition made by a
//! fault proxy in user space, and by the kernel (shop in a network
//! namespace of the test's own, its link to the servers taken down).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::netns::Netns;
use common::{account, host_port, pay, read, redis_url, via, Mode, RedisPrefix, Shop, BODY};
use idem_test_support::faults::{Fault, FaultProxy};

/// The statement time-out the shops run with: the answers must come well
/// before the partition heals.
const TIMEOUT_MS: u64 = 800;
/// How long the partition lasts: many times the time-out.
const PARTITION: Duration = Duration::from_secs(10);

/// Who makes the partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    /// The fault proxy holds every byte.
    ByProxy,
    /// The kernel: the veth link to the servers is down.
    ByKernel,
}

async fn a_partition_costs_a_bounded_wait(mode: Mode, made: Made) {
    let db = mode.db().await;
    let netns = (made == Made::ByKernel).then(Netns::create);
    let bind = netns
        .as_ref()
        .map_or("127.0.0.1".to_owned(), |n| n.servers_host_ip.clone());
    let database = FaultProxy::start_on(&bind, &host_port(&db.url())).await;
    let redis = FaultProxy::start_on(&bind, &host_port(&redis_url())).await;
    let prefix = RedisPrefix::new("network");
    let timeout = TIMEOUT_MS.to_string();
    let mut flags = mode.flags_with(&prefix.0, &via(&redis_url(), redis.addr()));
    flags.extend(["--statement-timeout-ms", &timeout, "--lease-ms", "3000"].map(str::to_owned));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let shop = Shop::start_in_netns(netns.as_ref(), &via(&db.url(), database.addr()), &flags).await;
    let client = common::signed_in();
    let before = account(&client, &shop, "acc_1").await;
    let done = read(pay(&client, &shop, Some("net-done"), BODY)).await;
    assert_eq!(done.status, 201);

    // The link to the store the mode depends on goes down.
    let link = match mode {
        Mode::RedisAlone => &redis,
        _ => &database,
    };
    match &netns {
        Some(ns) => ns.partition(),
        None => link.set(Fault::Partition),
    }
    let cut_at = Instant::now();
    for key in ["net-new", "net-done"] {
        let started = Instant::now();
        let answer =
            read(pay(&client, &shop, Some(key), BODY).timeout(PARTITION - Duration::from_secs(2)))
                .await;
        assert_eq!(answer.status, 503, "{key}: {answer:?}");
        assert!(answer.headers.contains_key("retry-after"), "{answer:?}");
        assert!(
            answer.problem_type().ends_with("unavailable"),
            "{key}: {answer:?}"
        );
        assert!(
            started.elapsed() < PARTITION - Duration::from_secs(2),
            "answered while the partition lasts"
        );
    }
    let health = read(
        client
            .get(shop.url("/healthz"))
            .timeout(Duration::from_secs(6)),
    )
    .await;
    assert_eq!(health.status, 503, "{health:?}");
    assert!(
        cut_at.elapsed() < PARTITION,
        "every answer came during the partition"
    );
    tokio::time::sleep(PARTITION.saturating_sub(cut_at.elapsed())).await;
    match &netns {
        Some(ns) => ns.heal(),
        None => link.set(Fault::None),
    }

    // Healed: the new key is charged once (retried past any claim its
    // first attempt left to the lease); the old one replays.
    let deadline = Instant::now() + Duration::from_secs(30);
    let created = loop {
        let a = read(pay(&client, &shop, Some("net-new"), BODY)).await;
        if a.status == 201 {
            break a;
        }
        assert!(
            [409, 503].contains(&a.status) && Instant::now() < deadline,
            "{a:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let replay = read(pay(&client, &shop, Some("net-new"), BODY)).await;
    assert!(replay.replayed);
    assert_eq!(replay.body, created.body);
    let old = read(pay(&client, &shop, Some("net-done"), BODY)).await;
    assert!(old.replayed);
    assert_eq!(old.body, done.body);
    let after = account(&client, &shop, "acc_1").await;
    for field in ["bank_charges", "payments"] {
        assert_eq!(
            after[field].as_i64().unwrap() - before[field].as_i64().unwrap_or(0),
            2,
            "two payments, each charged and recorded once: {before} -> {after}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    a_partition_costs_a_bounded_wait(Mode::Postgres, Made::ByProxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kernel_partition() {
    a_partition_costs_a_bounded_wait(Mode::Postgres, Made::ByKernel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql() {
    a_partition_costs_a_bounded_wait(Mode::Mysql, Made::ByProxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_kernel_partition() {
    a_partition_costs_a_bounded_wait(Mode::Mysql, Made::ByKernel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_in_transaction() {
    a_partition_costs_a_bounded_wait(Mode::ClaimInTx, Made::ByProxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_in_transaction_kernel_partition() {
    a_partition_costs_a_bounded_wait(Mode::ClaimInTx, Made::ByKernel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered() {
    a_partition_costs_a_bounded_wait(Mode::Tiered, Made::ByProxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_kernel_partition() {
    a_partition_costs_a_bounded_wait(Mode::Tiered, Made::ByKernel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone() {
    a_partition_costs_a_bounded_wait(Mode::RedisAlone, Made::ByProxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_alone_kernel_partition() {
    a_partition_costs_a_bounded_wait(Mode::RedisAlone, Made::ByKernel).await;
}
