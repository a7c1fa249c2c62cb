//! Orders and payments emit events through the outbox; consumers act on
//! them once through the inbox: in process, over RabbitMQ, over NATS.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{pay, read, Db, Shop, BODY};

const ORDER: &str = r#"{"customer_id":"cust-9","client_reference":"cart-9","items":[{"sku":"tea","qty":2},{"sku":"cup","qty":1}]}"#;

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many emails `shop` sent to `acc_1`.
async fn emails_sent(client: &reqwest::Client, shop: &Shop) -> usize {
    read(client.get(shop.url("/emails?account_id=acc_1")))
        .await
        .json()["emails"]
        .as_array()
        .unwrap()
        .len()
}

/// Waits until `/healthz` answers `503` problem `kind`, with
/// `Retry-After` and a detail that names each of `says`.
async fn wait_unhealthy(shop: &Shop, client: &reqwest::Client, kind: &str, says: &[&str]) {
    let health = async || read(client.get(shop.url("/healthz"))).await;
    eventually(&format!("healthz reporting {kind}"), async || {
        health().await.status == 503
    })
    .await;
    let answer = health().await;
    assert_eq!(answer.status, 503);
    assert!(answer.problem_type().ends_with(kind), "{answer:?}");
    let detail = answer.json()["detail"].as_str().unwrap().to_owned();
    for s in says {
        assert!(detail.contains(s), "the detail names {s}: {detail}");
    }
    assert!(answer.headers.contains_key("retry-after"));
}

async fn events_act_once(db: Db, broker: &[&str]) {
    let shops = [
        Shop::start(&db, broker).await,
        Shop::start(&db, broker).await,
    ];
    let client = common::signed_in();
    let order = || {
        client
            .post(shops[0].url("/orders"))
            .header("authorization", "Bearer client-1")
            .header("content-type", "application/json")
            .body(ORDER)
    };
    assert_eq!(read(order()).await.status, 201);
    assert_eq!(
        read(order()).await.status,
        200,
        "the same order: no second event"
    );
    let stock = |sku: &'static str| {
        let (client, url) = (client.clone(), shops[1].url(&format!("/stock/{sku}")));
        async move {
            read(client.get(url)).await.json()["reserved"]
                .as_i64()
                .unwrap()
        }
    };
    eventually("stock reserved", async || stock("tea").await == 2).await;
    assert_eq!(stock("cup").await, 1);

    let paid = read(pay(&client, &shops[1], Some("msg-pay-1"), BODY)).await;
    assert_eq!(paid.status, 201);
    let replay = read(pay(&client, &shops[0], Some("msg-pay-1"), BODY)).await;
    assert!(replay.replayed);
    let payment_id = paid.json()["id"].as_str().unwrap().to_owned();
    let emails = || {
        let (client, url) = (client.clone(), shops[0].url("/emails?account_id=acc_1"));
        async move {
            read(client.get(url)).await.json()["emails"]
                .as_array()
                .unwrap()
                .clone()
        }
    };
    eventually("the confirmation email", async || emails().await.len() == 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = emails().await;
    assert_eq!(sent.len(), 1, "one email per payment: {sent:?}");
    assert_eq!(sent[0]["payment_id"], payment_id.as_str());
    assert_eq!(stock("tea").await, 2, "still reserved once");
}

/// A relay that meets an error waiting cannot mend (here a column of its
/// table renamed away) stops; `/healthz` says so, naming the relay and the
/// error, until the supervisor's restart finds the table usable again; the
/// events enqueued meanwhile are then delivered, once each.
async fn a_stopped_relay_is_reported_and_restarted(db: Db) {
    let shop = Shop::start(&db, &[]).await;
    let client = common::signed_in();
    let emails = async || emails_sent(&client, &shop).await;
    assert_eq!(
        read(pay(&client, &shop, Some("relay-1"), BODY))
            .await
            .status,
        201
    );
    eventually("the first email", async || emails().await == 1).await;
    let health = async || read(client.get(shop.url("/healthz"))).await;
    assert_eq!(health().await.status, 200);

    db.execute("ALTER TABLE idem_outbox RENAME COLUMN claim_token TO claim_token_moved")
        .await;
    // Enqueueing does not need the column: the payment is taken, its event
    // waits.
    assert_eq!(
        read(pay(&client, &shop, Some("relay-2"), BODY))
            .await
            .status,
        201
    );
    wait_unhealthy(
        &shop,
        &client,
        "relay-stopped",
        &["outbox relay", "claim_token"],
    )
    .await;
    assert_eq!(emails().await, 1, "nothing published while it is stopped");

    db.execute("ALTER TABLE idem_outbox RENAME COLUMN claim_token_moved TO claim_token")
        .await;
    // The supervisor tries again after 1 s, then 2 s, 4 s…: well within
    // the wait.
    eventually("healthz after the restart", async || {
        health().await.status == 200
    })
    .await;
    eventually("the second email", async || emails().await == 2).await;
    let metrics = read(client.get(shop.url("/metrics"))).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics.contains("idem_outbox_relay_errors_total{error=\"fatal\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("shop_outbox_relay_restarts_total"),
        "{metrics}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(emails().await, 2, "one email per payment");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_relay_is_reported_and_restarted_on_sqlite() {
    a_stopped_relay_is_reported_and_restarted(Db::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_relay_is_reported_and_restarted_on_postgres() {
    a_stopped_relay_is_reported_and_restarted(Db::postgres().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_relay_is_reported_and_restarted_on_mysql() {
    a_stopped_relay_is_reported_and_restarted(Db::mysql().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_process_on_sqlite() {
    events_act_once(Db::sqlite(), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_process_on_postgres() {
    events_act_once(Db::postgres().await, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_rabbitmq() {
    let prefix = format!("shop-test-{}", uuid::Uuid::new_v4().simple());
    let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
    events_act_once(
        Db::postgres().await,
        &["--broker-url", url, "--broker-prefix", &prefix],
    )
    .await;
    delete_queues(url, &prefix).await;
}

/// Deletes the queues shop declared under `prefix`.
async fn delete_queues(url: &str, prefix: &str) {
    let publisher = idem_rabbitmq::RabbitPublisher::connect(url).await.unwrap();
    for q in ["orders.placed", "payments.authorized", "orders.paid"] {
        for name in [format!("{prefix}.{q}"), format!("{prefix}.{q}.dlq")] {
            let _ = publisher
                .channel()
                .queue_delete(name.into(), lapin::options::QueueDeleteOptions::default())
                .await;
        }
    }
}

/// A consumer that ends while shop runs (here its queue is deleted under
/// it, and RabbitMQ cancels it) is opened again, its queue declared again,
/// and the next event is handled: an event is never left without a
/// consumer until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_that_ends_is_opened_again() {
    let prefix = format!("shop-test-{}", uuid::Uuid::new_v4().simple());
    let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
    let db = Db::postgres().await;
    let shop = Shop::start(&db, &["--broker-url", url, "--broker-prefix", &prefix]).await;
    let client = common::signed_in();
    let emails = async || emails_sent(&client, &shop).await;
    assert_eq!(
        read(pay(&client, &shop, Some("reopen-1"), BODY))
            .await
            .status,
        201
    );
    eventually("the first email", async || emails().await == 1).await;

    let admin = idem_rabbitmq::RabbitPublisher::connect(url).await.unwrap();
    admin
        .channel()
        .queue_delete(
            format!("{prefix}.payments.authorized").into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
    let metrics = async || {
        let m = read(client.get(shop.url("/metrics"))).await;
        String::from_utf8_lossy(&m.body).into_owned()
    };
    eventually("the consumer opened again", async || {
        metrics()
            .await
            .lines()
            .any(|l| l.starts_with("shop_consumer_restarts_total{event=\"payments.authorized\"}"))
    })
    .await;
    assert_eq!(
        read(pay(&client, &shop, Some("reopen-2"), BODY))
            .await
            .status,
        201
    );
    eventually("the second email", async || emails().await == 2).await;
    drop(shop);
    delete_queues(url, &prefix).await;
}

/// A relay that falls behind (here the broker stops confirming: the link
/// to it partitioned) is reported by `/healthz` once the oldest waiting
/// event is older than `--outbox-max-lag-secs`, and the gauge says how far
/// behind; when the broker is back, the backlog goes out once each and
/// health returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_that_falls_behind_is_reported_until_it_catches_up() {
    use idem_test_support::faults::{Fault, FaultProxy};
    let broker = FaultProxy::start("127.0.0.1:5672").await;
    let url = format!("amqp://guest:guest@{}/%2f", broker.addr());
    let prefix = format!("shop-test-{}", uuid::Uuid::new_v4().simple());
    let db = Db::postgres().await;
    let shop = Shop::start(
        &db,
        &[
            "--broker-url",
            &url,
            "--broker-prefix",
            &prefix,
            "--outbox-max-lag-secs",
            "2",
        ],
    )
    .await;
    let client = common::signed_in();
    let emails = async || emails_sent(&client, &shop).await;
    let health = async || read(client.get(shop.url("/healthz"))).await;
    assert_eq!(
        read(pay(&client, &shop, Some("lag-1"), BODY)).await.status,
        201
    );
    eventually("the first email", async || emails().await == 1).await;
    assert_eq!(health().await.status, 200);

    broker.set(Fault::Partition);
    // Taking a payment does not need the broker: its event waits.
    assert_eq!(
        read(pay(&client, &shop, Some("lag-2"), BODY)).await.status,
        201
    );
    wait_unhealthy(&shop, &client, "outbox-lagging", &["outbox", "2 s"]).await;
    let metrics = read(client.get(shop.url("/metrics"))).await;
    let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
    let gauge: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("shop_outbox_lag_seconds "))
        .unwrap_or_else(|| panic!("no lag gauge: {metrics}"))
        .trim()
        .parse()
        .unwrap();
    assert!(gauge >= 2.0, "the gauge shows the wait: {gauge}");

    broker.set(Fault::None);
    eventually("healthz after the relay caught up", async || {
        health().await.status == 200
    })
    .await;
    eventually("the second email", async || emails().await == 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(emails().await, 2, "one email per payment");
    drop(shop);
    delete_queues("amqp://guest:guest@127.0.0.1:5672/%2f", &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_nats_jetstream() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let prefix = format!("shop-test-{id}");
    let url = "nats://127.0.0.1:4222";
    events_act_once(
        Db::postgres().await,
        &["--broker-url", url, "--broker-prefix", &prefix],
    )
    .await;
    let stream_prefix: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    let spec = idem_nats::StreamSpec::new(
        format!("{stream_prefix}_ORDERS"),
        format!("{prefix}.orders.placed"),
    );
    let publisher = idem_nats::NatsPublisher::connect(url, &spec).await.unwrap();
    for s in ["ORDERS", "PAYMENTS"] {
        let _ = publisher
            .context()
            .delete_stream(format!("{stream_prefix}_{s}"))
            .await;
    }
}

/// A consumer whose handler waits on a lock (another transaction holds the
/// stock row it updates) fails that message after the statement timeout
/// instead of waiting as long as the lock is held: the events behind it go
/// on, and the stuck one is processed, once, when it comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_stuck_on_a_lock_fails_its_message_in_time_and_goes_on() {
    let db = Db::postgres().await;
    let shop = Shop::start(
        &db,
        &[
            "--consumer-concurrency",
            "1",
            "--statement-timeout-ms",
            "500",
        ],
    )
    .await;
    let pool = sqlx::PgPool::connect(&db.url()).await.unwrap();
    sqlx::query("INSERT INTO shop_stock (sku, reserved) VALUES ('tea', 0)")
        .execute(&pool)
        .await
        .unwrap();
    let mut held = pool.begin().await.unwrap();
    sqlx::query("SELECT reserved FROM shop_stock WHERE sku = 'tea' FOR UPDATE")
        .execute(&mut *held)
        .await
        .unwrap();
    let client = common::signed_in();
    for (reference, sku) in [("stuck", "tea"), ("behind", "cup")] {
        let placed = read(
            client
                .post(shop.url("/orders"))
                .header("authorization", "Bearer client-1")
                .header("content-type", "application/json")
                .body(format!(
                    r#"{{"customer_id":"cust-9","client_reference":"{reference}","items":[{{"sku":"{sku}","qty":2}}]}}"#
                )),
        )
        .await;
        assert_eq!(placed.status, 201, "{placed:?}");
    }
    let stock = |sku: &'static str| {
        let (client, url) = (client.clone(), shop.url(&format!("/stock/{sku}")));
        async move {
            read(client.get(url)).await.json()["reserved"]
                .as_i64()
                .unwrap()
        }
    };
    eventually("the event behind the stuck one", async || {
        stock("cup").await == 2
    })
    .await;
    held.rollback().await.unwrap();
    eventually("the stuck event, once the lock is gone", async || {
        stock("tea").await == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stock("tea").await, 2, "reserved once");
    pool.close().await;
}
