//! `idem-relay-bench`: fills a PostgreSQL outbox with N committed messages,
//! then runs K relays publishing them through a real broker (RabbitMQ with
//! publisher confirms, NATS JetStream with acks) or in process, and reports
//! messages per second until every row is marked sent.
//!
//! ```text
//! idem-relay-bench --broker amqp://guest:guest@127.0.0.1:5672/%2f --messages 50000 --relays 2
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use idem_outbox::outbox::{self, OutgoingMessage, Publisher, Relay, RelayConfig};

/// Relay throughput through a real broker.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    database_url: String,
    /// `amqp://…`, `nats://…`, or `in-process`.
    #[arg(long, default_value = "in-process")]
    broker: String,
    /// Messages to relay.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Relays running at once.
    #[arg(long, default_value_t = 2)]
    relays: usize,
    /// Rows per relay round.
    #[arg(long, default_value_t = 500)]
    batch: i64,
}

async fn publisher(
    broker: &str,
    destination: &str,
) -> Result<(Arc<dyn Publisher>, Option<Box<dyn FnOnce() + Send>>), Box<dyn std::error::Error>> {
    if broker.starts_with("amqp") {
        let p = idem_rabbitmq::RabbitPublisher::connect(broker).await?;
        let spec = idem_rabbitmq::QueueSpec::new(destination);
        spec.declare(&p.channel()).await?;
        let channel = p.channel().clone();
        let names = [spec.name().to_owned(), spec.dead_letter_queue()];
        let cleanup: Box<dyn FnOnce() + Send> = Box::new(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    for n in names {
                        let _ = channel
                            .queue_delete(n.into(), lapin::options::QueueDeleteOptions::default())
                            .await;
                    }
                });
            }
        });
        Ok((Arc::new(p), Some(cleanup)))
    } else if broker.starts_with("nats") {
        // One stream per destination, shared by every relay's publisher.
        let stream = format!("BENCH_{}", destination.replace('.', "_"));
        let spec = idem_nats::StreamSpec::new(stream.clone(), destination);
        let p = idem_nats::NatsPublisher::connect(broker, &spec).await?;
        let ctx = p.context().clone();
        let cleanup: Box<dyn FnOnce() + Send> = Box::new(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    let _ = ctx.delete_stream(stream).await;
                });
            }
        });
        Ok((Arc::new(p), Some(cleanup)))
    } else {
        let t = Arc::new(idem_outbox::transport::InProcess::new());
        let mut rx = t.subscribe(destination);
        tokio::spawn(async move {
            while let Some(d) = rx.recv().await {
                d.ack();
            }
        });
        Ok((t, None))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let schema = format!("bench_relay_{}", uuid::Uuid::new_v4().simple());
    let admin = sqlx::PgPool::connect(&args.database_url).await?;
    sqlx::raw_sql(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await?;
    let result = bench(&args, &schema).await;
    // The schema goes whatever happened.
    sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&admin)
        .await?;
    result
}

async fn bench(args: &Args, schema: &str) -> Result<(), Box<dyn std::error::Error>> {
    let sep = if args.database_url.contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!(
        "{}{sep}options=-c%20search_path%3D{schema}",
        args.database_url
    );
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await?;
    outbox::migrate(&pool).await?;
    let destination = format!("bench.{}", uuid::Uuid::new_v4().simple());
    for chunk in (0..args.messages).collect::<Vec<_>>().chunks(1000) {
        let mut tx = pool.begin().await?;
        for i in chunk {
            let m = OutgoingMessage {
                message_id: format!("bench-{i}"),
                destination: destination.clone(),
                ordering_key: None,
                payload: Bytes::from(format!(
                    r#"{{"order_id":"ord-{i}","items":[{{"sku":"tea","qty":1}}]}}"#
                )),
                headers: vec![("type".into(), "OrderPlaced".into())],
            };
            outbox::enqueue(&mut tx, &m).await?;
        }
        tx.commit().await?;
    }
    let mut cleanups = Vec::new();
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let config = RelayConfig {
        batch: args.batch,
        poll: Duration::from_millis(20),
        ..RelayConfig::default()
    };
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.relays {
        let (p, cleanup) = publisher(&args.broker, &destination).await?;
        cleanups.extend(cleanup);
        tasks.push(tokio::spawn(
            Relay::new(&pool, p, config.clone()).run(stop_rx.clone()),
        ));
    }
    loop {
        let s = outbox::stats(&pool).await?;
        if s.sent as usize >= args.messages {
            break;
        }
        if s.dead > 0 {
            return Err(format!("{} messages dead-lettered", s.dead).into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "{:<12} relays {}  batch {}  {} messages in {:.2} s = {:.0} messages/s",
        args.broker.split(':').next().unwrap_or("?"),
        args.relays,
        args.batch,
        args.messages,
        elapsed.as_secs_f64(),
        args.messages as f64 / elapsed.as_secs_f64()
    );
    pool.close().await;
    for c in cleanups {
        let _ = tokio::task::spawn_blocking(c).await;
    }
    Ok(())
}
