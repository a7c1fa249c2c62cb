//! `idem-grpc-bench`: one unary gRPC method served twice in this process,
//! bare and behind idem's layer, driven by a tonic client at a fixed
//! concurrency over one HTTP/2 connection. Prints a Markdown table: bare
//! and new alternated in rounds (medians), replay and in-flight once.
//!
//! ```text
//! idem-grpc-bench --store postgres --requests 5000 --concurrency 32 --rounds 7
//! ```
//!
//! The server runs on one runtime thread and the client on another, so the
//! two share the machine's cores the same way in every row.

// A measuring tool: a setup that fails (a port, a runtime, the database)
// stops it with the reason, and there is nothing to measure.
#![allow(clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use http::uri::PathAndQuery;
use idem_core::{Policy, Store};
use idem_tonic::{IdempotencyLayer, SingleScope};
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

const PATH: &str = "/bench.v1.Payments/Create";

/// The request message.
#[derive(Clone, PartialEq, prost::Message)]
struct Create {
    #[prost(string, tag = "1")]
    account_id: String,
    #[prost(int64, tag = "2")]
    amount: i64,
    /// How long the handler takes, in milliseconds (the in-flight originals).
    #[prost(uint64, tag = "3")]
    delay_ms: u64,
}

/// The answer.
#[derive(Clone, PartialEq, prost::Message)]
struct Created {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

/// Which store the layer keeps records in.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum StoreKind {
    Memory,
    Postgres,
}

/// A unary gRPC call with and without idem's layer.
#[derive(Debug, Parser)]
struct Args {
    /// The layer's store.
    #[arg(long, value_enum, default_value_t = StoreKind::Memory)]
    store: StoreKind,
    /// PostgreSQL, for `--store postgres` (records in a table of this run's own).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// Calls per scenario.
    #[arg(long, default_value_t = 5000)]
    requests: usize,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Rounds of bare and new, alternated.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// The service, written as tonic's generated code is.
#[derive(Clone)]
struct Payments;

impl NamedService for Payments {
    const NAME: &'static str = "bench.v1.Payments";
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl tower::Service<http::Request<Body>> for Payments {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Created, Create>::default());
            Ok(grpc.unary(Handler, request).await)
        })
    }
}

struct Handler;

impl tonic::server::UnaryService<Create> for Handler {
    type Response = Created;
    type Future = BoxFuture<Result<Response<Created>, Status>>;

    fn call(&mut self, request: Request<Create>) -> Self::Future {
        Box::pin(async move {
            let create = request.into_inner();
            if create.delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(create.delay_ms)).await;
            }
            Ok(Response::new(Created {
                id: uuid::Uuid::now_v7().to_string(),
                amount: create.amount,
            }))
        })
    }
}

/// Serves on a runtime thread of its own; the address.
fn serve(layer: Option<IdempotencyLayer>) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("server runtime");
        runtime.block_on(async move {
            listener.set_nonblocking(true).expect("nonblocking");
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let served = match layer {
                Some(layer) => {
                    Server::builder()
                        .layer(layer)
                        .add_service(Payments)
                        .serve_with_incoming(incoming)
                        .await
                }
                None => {
                    Server::builder()
                        .add_service(Payments)
                        .serve_with_incoming(incoming)
                        .await
                }
            };
            if let Err(e) = served {
                eprintln!("server failed: {e}");
            }
        });
    });
    addr
}

/// What one call carries.
#[derive(Debug, Clone)]
struct Call {
    key: Option<String>,
    delay_ms: u64,
}

/// One scenario's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: usize,
}

async fn one(channel: Channel, call: Call) -> Result<(), Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut request = Request::new(Create {
        account_id: "acc_bench".into(),
        amount: 100,
        delay_ms: call.delay_ms,
    });
    if let Some(key) = call.key {
        let key = key.parse().map_err(|_| Status::internal("key"))?;
        request.metadata_mut().insert("idempotency-key", key);
    }
    grpc.unary::<_, Created, _>(
        request,
        PathAndQuery::from_static(PATH),
        ProstCodec::default(),
    )
    .await
    .map(drop)
}

/// Sends `calls` at `concurrency`; `expected` is the status every answer
/// should have (`Ok`, or `Aborted` for in-flight duplicates).
async fn drive(
    channel: &Channel,
    calls: Vec<Call>,
    concurrency: usize,
    expected: tonic::Code,
) -> Figures {
    let calls = Arc::new(std::sync::Mutex::new(calls));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let calls = calls.clone();
        let channel = channel.clone();
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0;
            loop {
                let next = calls.lock().ok().and_then(|mut c| c.pop());
                let Some(call) = next else { break };
                let t = Instant::now();
                let code = match one(channel.clone(), call).await {
                    Ok(()) => tonic::Code::Ok,
                    Err(s) => s.code(),
                };
                latencies.push(t.elapsed());
                if code != expected {
                    errors += 1;
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for w in workers {
        if let Ok((l, e)) = w.await {
            latencies.extend(l);
            errors += e;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    let at = |q: f64| {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(i).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    Figures {
        rps: latencies.len() as f64 / elapsed,
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        errors,
    }
}

fn keyed(n: usize, prefix: &str) -> Vec<Call> {
    (0..n)
        .map(|i| Call {
            key: Some(format!("{prefix}-{i}-{}", uuid::Uuid::new_v4().simple())),
            delay_ms: 0,
        })
        .collect()
}

fn median(mut v: Vec<Figures>) -> Figures {
    v.sort_by(|a, b| a.rps.total_cmp(&b.rps));
    let mut m = v[v.len() / 2];
    let mut p: Vec<f64> = v.iter().map(|f| f.p50_ms).collect();
    p.sort_by(f64::total_cmp);
    m.p50_ms = p[p.len() / 2];
    m.errors = v.iter().map(|f| f.errors).sum();
    m
}

/// The layer's store, and the table to drop afterwards (PostgreSQL).
async fn store(args: &Args) -> (Arc<dyn Store>, Option<String>) {
    match args.store {
        StoreKind::Memory => (Arc::new(idem_memory::MemoryStore::new()), None),
        StoreKind::Postgres => {
            let name = format!("idem_grpc_bench_{}", uuid::Uuid::new_v4().simple());
            let table = idem_postgres::TableName::new(None, &name).expect("table name");
            let store = idem_postgres::PostgresStore::connect_with(&args.database_url, table)
                .await
                .expect("PostgreSQL");
            (Arc::new(store), Some(name))
        }
    }
}

/// Leaves the database as it was found.
async fn drop_table(url: &str, table: &str) {
    use sqlx::Connection;
    match sqlx::PgConnection::connect(url).await {
        Ok(mut conn) => {
            if let Err(e) = sqlx::query(&format!("DROP TABLE IF EXISTS \"{table}\""))
                .execute(&mut conn)
                .await
            {
                eprintln!("could not drop {table}: {e}");
            }
            let _ = conn.close().await;
        }
        Err(e) => eprintln!("could not drop {table}: {e}"),
    }
}

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("client runtime");
    runtime.block_on(run(args));
}

async fn run(args: Args) {
    let (store, table) = store(&args).await;
    let layer = IdempotencyLayer::new(store, Policy::default(), SingleScope("bench".into()))
        .unary::<Create>(PATH);
    let bare_addr = serve(None);
    let guarded_addr = serve(Some(layer));
    let connect = |addr: SocketAddr| async move {
        let endpoint = Channel::from_shared(format!("http://{addr}")).expect("uri");
        for _ in 0..100 {
            if let Ok(ch) = endpoint.connect().await {
                return ch;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("cannot connect to {addr}");
    };
    let bare = connect(bare_addr).await;
    let guarded = connect(guarded_addr).await;
    let (n, c) = (args.requests, args.concurrency);
    let warm = |ch: Channel| async move {
        drive(&ch, keyed(500, "warm"), c, tonic::Code::Ok).await;
    };
    warm(bare.clone()).await;
    warm(guarded.clone()).await;

    let (mut bares, mut news) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds.max(1) {
        let unkeyed = vec![
            Call {
                key: None,
                delay_ms: 0
            };
            n
        ];
        bares.push(drive(&bare, unkeyed, c, tonic::Code::Ok).await);
        news.push(drive(&guarded, keyed(n, "new"), c, tonic::Code::Ok).await);
    }
    // Replays: 200 completed keys, sent again.
    let completed = keyed(200, "done");
    drive(&guarded, completed.clone(), c, tonic::Code::Ok).await;
    let replays: Vec<Call> = (0..n)
        .map(|i| completed[i % completed.len()].clone())
        .collect();
    let replay = drive(&guarded, replays, c, tonic::Code::Ok).await;
    // In flight: 32 originals still running (10 s), their duplicates ABORTED.
    let originals: Vec<Call> = keyed(32, "slow")
        .into_iter()
        .map(|k| Call {
            delay_ms: 10_000,
            ..k
        })
        .collect();
    for o in originals.clone() {
        tokio::spawn(one(guarded.clone(), o));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dups: Vec<Call> = (0..n)
        .map(|i| Call {
            delay_ms: 10_000,
            ..originals[i % originals.len()].clone()
        })
        .collect();
    let inflight = drive(&guarded, dups, c, tonic::Code::Aborted).await;

    if let Some(table) = table {
        drop_table(&args.database_url, &table).await;
    }
    let bare = median(bares);
    let new = median(news);
    let config = match args.store {
        StoreKind::Memory => "grpc (memory)",
        StoreKind::Postgres => "grpc (postgres)",
    };
    let rounds = args.rounds.max(1);
    for (scenario, f, runs) in [
        ("bare", bare, rounds),
        ("new", new, rounds),
        ("replay", replay, 1),
        ("inflight", inflight, 1),
    ] {
        println!(
            "| {config} | {scenario} | {:.0} | {:.2} | {:.2} | {} | {:.2}x | {:.2}x | {runs} |",
            f.rps,
            f.p50_ms,
            f.p99_ms,
            f.errors,
            f.rps / bare.rps,
            f.p50_ms / bare.p50_ms,
        );
    }
}
