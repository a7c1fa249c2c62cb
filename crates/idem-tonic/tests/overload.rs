//! `max_running`: calls cancelled mid-way leave their handlers running (to
//! store their answers), and those count, so a client that opens a call
//! and cancels it, again and again on one connection, cannot start
//! handlers without end. (A binary of its own: the count of running
//! handlers is the process's.)

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use idem_core::Policy;
use idem_tonic::{IdempotencyLayer, LayerRefusal, MetadataScope};
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;

const PAY: &str = "/test.v1.Gate/Pay";

#[derive(Clone, PartialEq, prost::Message)]
pub struct Pay {
    #[prost(int64, tag = "1")]
    pub amount: i64,
}

/// A service whose handlers wait for a permit before they answer.
#[derive(Clone)]
struct Gate {
    open: Arc<Semaphore>,
    started: Arc<AtomicUsize>,
}

impl NamedService for Gate {
    const NAME: &'static str = "test.v1.Gate";
}

struct PayCall(Gate);

impl tonic::server::UnaryService<Pay> for PayCall {
    type Response = Pay;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<Pay>, Status>> + Send>>;

    fn call(&mut self, request: Request<Pay>) -> Self::Future {
        let gate = self.0.clone();
        Box::pin(async move {
            gate.started.fetch_add(1, Ordering::SeqCst);
            gate.open.acquire().await.unwrap().forget();
            Ok(Response::new(request.into_inner()))
        })
    }
}

impl tower::Service<http::Request<Body>> for Gate {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
    >;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let gate = self.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Pay, Pay>::default());
            Ok(grpc.unary(PayCall(gate), request).await)
        })
    }
}

async fn pay(channel: Channel, key: String) -> Result<Response<Pay>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = Request::new(Pay { amount: 1 });
    request
        .metadata_mut()
        .insert("x-client-id", "a".parse().unwrap());
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    grpc.unary(
        request,
        PathAndQuery::from_static(PAY),
        ProstCodec::<Pay, Pay>::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_count_until_their_handlers_end() {
    let gate = Gate {
        open: Arc::new(Semaphore::new(0)),
        started: Arc::new(AtomicUsize::new(0)),
    };
    let layer = IdempotencyLayer::new(
        Arc::new(idem_memory::MemoryStore::new()),
        Policy::default(),
        MetadataScope::new("x-client-id"),
    )
    .unary::<Pay>(PAY)
    .max_running(3);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(gate.clone())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // Three calls on one connection, each cancelled once its handler has
    // started: the handlers run on, and no call is open.
    for n in 0..3 {
        let call = tokio::spawn(pay(channel.clone(), format!("k{n}")));
        while gate.started.load(Ordering::SeqCst) == n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        call.abort();
        let _ = call.await;
    }
    assert_eq!(idem_once::detached::running(), 3);

    // The next is refused before anything is read or claimed, with a hint.
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        pay(channel.clone(), "k-next".to_owned()),
    )
    .await
    .expect("refused at once, not run")
    .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(LayerRefusal::of(&refused), Some(LayerRefusal::Overloaded));
    assert_eq!(
        refused.metadata().get("grpc-retry-pushback-ms").unwrap(),
        "1000"
    );
    assert_eq!(gate.started.load(Ordering::SeqCst), 3, "no handler more");

    // Once the handlers end, the same key runs.
    gate.open.add_permits(4);
    tokio::time::timeout(Duration::from_secs(30), idem_once::detached::idle())
        .await
        .expect("the handlers never ended");
    let ran = pay(channel.clone(), "k-next".to_owned()).await.unwrap();
    assert_eq!(ran.into_inner().amount, 1);
    assert_eq!(gate.started.load(Ordering::SeqCst), 4);
}
