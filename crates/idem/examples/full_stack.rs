//! A whole service: records in PostgreSQL with Redis in front, an order
//! and its event committed together, the event relayed through NATS
//! JetStream to a consumer that acts once (the inbox), and a client that
//! retries one intent under one key.
use std::{sync::Arc, time::Duration};

use axum::{http::StatusCode, response::Response, routing::post, Router};
use idem::axum::{Guarded, IdempotencyLayer, SingleScope};
use idem::client::{reqwest, reqwest_middleware, IdempotentRetry, IntentKey, RetryOutcomeExt};
use idem::nats::{NatsConsumer, NatsPublisher, StreamSpec};
use idem::outbox::consumer::{self, Consumer, Delivery};
use idem::outbox::{Handled, InboxTable, OutboxTable, OutgoingMessage, Relay, RelayConfig};
use idem::postgres::{PostgresStore, TableName};
use idem::redis::{RedisConfig, RedisStore, TieredStore};
use idem::{sqlx, Policy};

type Store = Arc<TieredStore<PostgresStore>>;

#[derive(Clone)]
struct Tables {
    store: Store,
    outbox: OutboxTable,
    orders: String,
    subject: String,
}

/// `Guarded<Store>` takes the store from the state (the compiler checks its type).
impl axum::extract::FromRef<Tables> for Store {
    fn from_ref(t: &Tables) -> Store {
        t.store.clone()
    }
}

async fn create_order(
    guard: Guarded<Store>,
    axum::extract::State(t): axum::extract::State<Tables>,
    body: String,
) -> Response {
    let id = guard.operation_id().to_string();
    guard
        .transaction(async |tx| {
            sqlx::query(&format!(
                "INSERT INTO {} (id, body) VALUES ($1, $2)",
                t.orders
            ))
            .bind(&id)
            .bind(&body)
            .execute(&mut *tx)
            .await?;
            // The event commits with the order, or neither does.
            let event = OutgoingMessage::new(format!("order-{id}"), t.subject, body);
            t.outbox.enqueue(tx, &event).await?;
            Ok((StatusCode::CREATED, id))
        })
        .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let database = var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let nats = var("NATS_URL", "nats://127.0.0.1:4222");
    let run = var("RUN_ID", "demo"); // names this run's schema, stream and Redis prefix
    let schema = format!("walk_{run}");

    // Records in PostgreSQL (in a schema of their own), Redis in front.
    let sql =
        PostgresStore::connect_with(&database, TableName::new(Some(&schema), "idem_records")?)
            .await?;
    let pool = sql.pool().clone();
    let redis = RedisStore::connect(
        RedisConfig::new(var("REDIS_URL", "redis://127.0.0.1:6379")).prefix(format!("walk-{run}")),
    )
    .await?;
    let store: Store = Arc::new(TieredStore::new(sql, redis));

    // The outbox and the inbox, in the same schema.
    let outbox = OutboxTable::new(Some(&schema), "outbox")?;
    let inbox = InboxTable::new(Some(&schema), "inbox")?;
    outbox.migrate(&pool).await?;
    inbox.migrate(&pool).await?;
    let orders = format!("\"{schema}\".orders");
    let counted = format!("\"{schema}\".orders_counted");
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {orders} (id text PRIMARY KEY, body text)"
    ))
    .execute(&pool)
    .await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {counted} (message_id text)"
    ))
    .execute(&pool)
    .await?;

    // The relay publishes what committed; the consumer acts once per message.
    let spec = StreamSpec::new(format!("WALK_{run}"), format!("walk.{run}.orders"));
    let publisher = NatsPublisher::connect(&nats, &spec).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let config = RelayConfig {
        table: outbox.clone(),
        ..RelayConfig::default()
    };
    let relay =
        tokio::spawn(Relay::new(&pool, Arc::new(publisher.clone()), config).run(stopped.clone()));
    let consumer = NatsConsumer::connect(&nats, &spec, "count-orders", 5).await?;
    let (pool2, inbox2, counted2) = (pool.clone(), inbox.clone(), counted.clone());
    // One way to consume, whatever the broker: the Consumer trait.
    let on_message = consumer::handler(move |m: Delivery| {
        let (pool, inbox, counted) = (pool2.clone(), inbox2.clone(), counted2.clone());
        async move {
            let id = m.message_id.ok_or("a message without an id")?;
            let (insert, row) = (format!("INSERT INTO {counted} VALUES ($1)"), id.clone());
            let done = inbox
                .process(&pool, "count-orders", &id, async move |tx| {
                    sqlx::query(&insert).bind(row).execute(&mut *tx).await?;
                    Ok::<_, sqlx::Error>(())
                })
                .await?;
            if done == Handled::Duplicate {
                println!("a redelivery, acknowledged without acting again");
            }
            Ok(())
        }
    });
    let consuming = tokio::spawn(Box::new(consumer).consume(on_message, stopped));

    // The HTTP service: the layer claims in the store, handlers complete in it.
    let layer =
        IdempotencyLayer::from_store(store.clone(), Policy::default(), SingleScope("walk".into()));
    let app = Router::new()
        .route("/orders", post(create_order).route_layer(layer))
        .with_state(Tables {
            store,
            outbox,
            orders,
            subject: spec.subject().to_owned(),
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/orders", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    // The client: one intent, one key, sent twice (a reply lost and retried).
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(IdempotentRetry::default())
        .build();
    let intent = IntentKey::new(format!("order-{run}"));
    let mut ids = Vec::new();
    for _ in 0..2 {
        let response = client
            .post(&url)
            .body("2 espressos")
            .with_extension(intent.clone())
            .send()
            .await?;
        let replayed = response.retry_outcome().is_some_and(|o| o.replayed);
        println!("{} replayed={replayed}", response.status());
        ids.push(response.text().await?);
    }
    assert_eq!(ids[0], ids[1], "the retry got the first answer");

    // Wait for the event to travel: committed, relayed, consumed once.
    let mut consumed = 0i64;
    for _ in 0..300 {
        consumed = sqlx::query_scalar(&format!("SELECT count(*) FROM {counted}"))
            .fetch_one(&pool)
            .await?;
        if consumed > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let orders: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".orders"))
        .fetch_one(&pool)
        .await?;
    println!("orders: {orders}, events consumed: {consumed}");
    assert_eq!(
        (orders, consumed),
        (1, 1),
        "one order, its event acted on once"
    );
    stop.send(true)?;
    relay.await??;
    consuming.await?.map_err(|e| e.to_string())?;
    publisher.context().delete_stream(spec.stream()).await?;
    server.abort();
    Ok(())
}
