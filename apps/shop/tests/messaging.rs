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
    let publisher = idem_rabbitmq::RabbitPublisher::connect(url).await.unwrap();
    for q in ["orders.placed", "payments.authorized"] {
        for name in [format!("{prefix}.{q}"), format!("{prefix}.{q}.dlq")] {
            let _ = publisher
                .channel()
                .queue_delete(name.into(), lapin::options::QueueDeleteOptions::default())
                .await;
        }
    }
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
