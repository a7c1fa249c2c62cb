//! The layer on a real tonic server over TCP, called by a real tonic
//! client: the contract, call by call, on the memory store and on
//! PostgreSQL (racing duplicates).

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use idem_core::{Policy, Store};
use idem_tonic::{
    Idempotency, IdempotencyLayer, IdempotentRetryLayer, IntentKey, MetadataScope, RetryError,
    RetryOutcome,
};
use tonic::body::Body;
use tonic::codec::CompressionEncoding;
use tonic::server::NamedService;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;

const CHARGE: &str = "/test.v1.Bank/Charge";
const BALANCE: &str = "/test.v1.Bank/Balance";

#[derive(Clone, PartialEq, prost::Message)]
pub struct Charge {
    #[prost(string, tag = "1")]
    pub account: String,
    #[prost(int64, tag = "2")]
    pub amount: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Receipt {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub operation_id: String,
    #[prost(int64, tag = "3")]
    pub amount: i64,
}

/// What the bank did: each charge it ran, by account.
#[derive(Default)]
struct Ledger {
    runs: Mutex<HashMap<String, Vec<(String, String)>>>,
    ids: AtomicUsize,
}

impl Ledger {
    fn runs(&self, account: &str) -> Vec<(String, String)> {
        self.runs
            .lock()
            .unwrap()
            .get(account)
            .cloned()
            .unwrap_or_default()
    }
}

/// A bank written the way tonic's generated code is: one route per method.
#[derive(Clone)]
struct Bank(Arc<Ledger>);

impl NamedService for Bank {
    const NAME: &'static str = "test.v1.Bank";
}

impl tower::Service<http::Request<Body>> for Bank {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
    >;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let bank = self.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Receipt, Charge>::default())
                .accept_compressed(CompressionEncoding::Gzip)
                .send_compressed(CompressionEncoding::Gzip);
            Ok(match request.uri().path() {
                CHARGE | BALANCE => grpc.unary(ChargeCall(bank), request).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct ChargeCall(Bank);

impl tonic::server::UnaryService<Charge> for ChargeCall {
    type Response = Receipt;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<Receipt>, Status>> + Send>,
    >;

    fn call(&mut self, request: Request<Charge>) -> Self::Future {
        let ledger = self.0 .0.clone();
        Box::pin(async move {
            let idem = request.extensions().get::<Idempotency>().cloned();
            let operation = idem
                .as_ref()
                .map(|i| i.operation_id().to_string())
                .unwrap_or_default();
            let key = request
                .metadata()
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let charge = request.into_inner();
            let account = charge.account.clone();
            let attempt = {
                let mut runs = ledger.runs.lock().unwrap();
                let runs = runs.entry(account.clone()).or_default();
                runs.push((operation.clone(), key));
                runs.len()
            };
            if let Some(ms) = account.strip_prefix("slow-") {
                tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
            }
            match account.as_str() {
                "unavailable-once" if attempt == 1 => return Err(Status::unavailable("try again")),
                "not-found" => return Err(Status::not_found("no such account")),
                "conflicted" => return Err(Status::aborted("the handler's own conflict")),
                "panics-once" if attempt == 1 => panic!("the handler panicked"),
                _ => {}
            }
            // Handlers that settle their claim themselves, on their first
            // attempt.
            if let Some(idem) = idem.as_ref().filter(|_| attempt == 1) {
                match account.as_str() {
                    "unknown-once" => {
                        idem.keep_claim();
                        return Err(Status::unavailable("the downstream call timed out"));
                    }
                    "unknown-panics-once" => {
                        idem.keep_claim();
                        panic!("the handler panicked mid-call");
                    }
                    "known-after-all-once" => {
                        idem.keep_claim();
                        idem.settle_by_answer();
                        return Err(Status::unavailable("refused before anything was sent"));
                    }
                    "rate-limited-once" => {
                        idem.release_claim();
                        return Err(Status::resource_exhausted("the downstream's rate limit"));
                    }
                    "lost-once" => {
                        idem.abandon();
                        return Err(Status::aborted("this attempt's lease ran out"));
                    }
                    // Statuses a handler passes on from calls it made.
                    "passes-in-flight-once" => {
                        return Err(idem_tonic::LayerRefusal::InFlight
                            .status(Code::Aborted, "the service it called is running this"));
                    }
                    "unimplemented-once" => {
                        return Err(Status::unimplemented("not served here yet"))
                    }
                    "data-loss-once" => return Err(Status::data_loss("a page went missing")),
                    // A rate limit answered without a word to the layer.
                    "exhausted-once" => {
                        return Err(Status::resource_exhausted("over the rate limit"))
                    }
                    "cancelled-once" => {
                        return Err(Status::cancelled("the call it made was cut off"))
                    }
                    _ => {}
                }
            }
            let id = ledger.ids.fetch_add(1, Ordering::SeqCst);
            let mut response = Response::new(Receipt {
                id: format!("rcpt_{id}"),
                operation_id: operation,
                amount: charge.amount,
            });
            response
                .metadata_mut()
                .insert("x-cost", id.to_string().parse().unwrap());
            response
                .metadata_mut()
                .insert("x-trace", "per-call".parse().unwrap());
            if let Some(idem) = &idem {
                let left = idem.lease_left().as_millis().to_string();
                response
                    .metadata_mut()
                    .insert("x-lease-left-ms", left.parse().unwrap());
            }
            Ok(response)
        })
    }
}

/// A server on a port of its own, with the layer over `store`.
async fn serve(store: Arc<dyn Store>, policy: Policy) -> (SocketAddr, Arc<Ledger>) {
    serve_with_limit(store, policy, None).await
}

/// [`serve`], with tonic's own time limit for a call (outside the layer).
async fn serve_with_limit(
    store: Arc<dyn Store>,
    policy: Policy,
    limit: Option<Duration>,
) -> (SocketAddr, Arc<Ledger>) {
    let layer = IdempotencyLayer::new(store, policy, MetadataScope::new("x-client-id"))
        .unary_checked(CHARGE, |_, charge: &Charge| {
            if charge.amount > 0 {
                Ok(())
            } else {
                Err(Status::invalid_argument("amount must be positive"))
            }
        })
        .replay_metadata("x-cost");
    serve_layer(layer, limit).await
}

/// A server on a port of its own, behind `layer`.
async fn serve_layer(
    layer: IdempotencyLayer,
    limit: Option<Duration>,
) -> (SocketAddr, Arc<Ledger>) {
    let ledger = Arc::new(Ledger::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bank = Bank(ledger.clone());
    let mut builder = Server::builder();
    if let Some(limit) = limit {
        builder = builder.timeout(limit);
    }
    tokio::spawn(
        builder
            .layer(layer)
            .add_service(bank)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (addr, ledger)
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// One call: the answer's metadata and message, or its status.
async fn call<T>(
    channel: T,
    path: &'static str,
    client: &str,
    key: Option<&str>,
    charge: Charge,
) -> Result<Response<Receipt>, Status>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let key = key.map(Key::Metadata);
    call_on(
        &mut tonic::client::Grpc::new(channel),
        path,
        client,
        key,
        charge,
    )
    .await
}

/// How a call names its key.
enum Key<'a> {
    /// As `idempotency-key` metadata.
    Metadata(&'a str),
    /// As an [`IntentKey`] for the client layer.
    Intent(&'a str),
}

/// One call on a client of the caller's (compression, layers).
async fn call_on<T>(
    grpc: &mut tonic::client::Grpc<T>,
    path: &'static str,
    client: &str,
    key: Option<Key<'_>>,
    charge: Charge,
) -> Result<Response<Receipt>, Status>
where
    T: tonic::client::GrpcService<Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    grpc.ready()
        .await
        .map_err(|e| Status::unknown(e.into().to_string()))?;
    let mut request = Request::new(charge);
    request
        .metadata_mut()
        .insert("x-client-id", client.parse().unwrap());
    match key {
        Some(Key::Metadata(key)) => {
            request
                .metadata_mut()
                .insert("idempotency-key", key.parse().unwrap());
        }
        Some(Key::Intent(key)) => {
            request.extensions_mut().insert(IntentKey::new(key));
        }
        None => {}
    }
    grpc.unary(
        request,
        PathAndQuery::from_static(path),
        ProstCodec::<Charge, Receipt>::default(),
    )
    .await
}

fn charge(account: &str, amount: i64) -> Charge {
    Charge {
        account: account.to_owned(),
        amount,
    }
}

fn replayed<T>(response: &Response<T>) -> bool {
    response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

fn memory() -> Arc<dyn Store> {
    Arc::new(idem_memory::MemoryStore::new())
}

#[tokio::test]
async fn a_replay_is_the_first_answer_marked_and_only_allow_listed_metadata() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let first = call(ch.clone(), CHARGE, "c1", Some("k1"), charge("acc", 100))
        .await
        .unwrap();
    assert!(!replayed(&first));
    let again = call(ch.clone(), CHARGE, "c1", Some("k1"), charge("acc", 100))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
    assert!(!first.get_ref().operation_id.is_empty());
    assert_eq!(
        again.metadata().get("x-cost"),
        first.metadata().get("x-cost")
    );
    assert!(first.metadata().get("x-trace").is_some());
    assert!(
        again.metadata().get("x-trace").is_none(),
        "not allow-listed"
    );
    assert_eq!(ledger.runs("acc").len(), 1);

    // The same key in another scope is another call.
    let other = call(ch.clone(), CHARGE, "c2", Some("k1"), charge("acc", 100))
        .await
        .unwrap();
    assert!(!replayed(&other));
    assert_ne!(other.get_ref().id, first.get_ref().id);
    assert_eq!(ledger.runs("acc").len(), 2);
}

#[tokio::test]
async fn a_key_reused_with_another_message_is_failed_precondition() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    call(ch.clone(), CHARGE, "c1", Some("k"), charge("acc", 100))
        .await
        .unwrap();
    let other = call(ch.clone(), CHARGE, "c1", Some("k"), charge("acc", 101))
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition);
    assert!(
        other.message().contains("another request message"),
        "{}",
        other.message()
    );
    // The layer's refusal says so in its details (`google.rpc.ErrorInfo`),
    // which a handler's own FAILED_PRECONDITION does not.
    assert_eq!(
        idem_tonic::LayerRefusal::of(&other),
        Some(idem_tonic::LayerRefusal::KeyReused)
    );
    let info = error_info(&other).expect("an ErrorInfo detail");
    assert_eq!(
        (info.reason.as_str(), info.domain.as_str()),
        ("IDEMPOTENCY_KEY_REUSED", "idem")
    );
    assert_eq!(ledger.runs("acc").len(), 1);
    // A handler's own status (stored, replayed) carries no such detail.
    for _ in 0..2 {
        let own = call(
            ch.clone(),
            CHARGE,
            "c1",
            Some("own"),
            charge("conflicted", 1),
        )
        .await
        .unwrap_err();
        assert_eq!(own.code(), Code::Aborted);
        assert_eq!(idem_tonic::LayerRefusal::of(&own), None, "{own:?}");
    }
}

/// `google.rpc.Status` and `google.rpc.ErrorInfo`, as a client decodes
/// them.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
}

/// The `ErrorInfo` of `status`'s details, decoded as any gRPC client
/// would, checked against the status itself.
fn error_info(status: &Status) -> Option<ErrorInfo> {
    use prost::Message;
    let rpc = RpcStatus::decode(status.details()).ok()?;
    assert_eq!(rpc.code, status.code() as i32);
    assert_eq!(rpc.message, status.message());
    let any = rpc.details.first()?;
    assert_eq!(any.type_url, "type.googleapis.com/google.rpc.ErrorInfo");
    ErrorInfo::decode(any.value.as_slice()).ok()
}

#[tokio::test]
async fn keys_are_required_checked_and_other_methods_pass_through() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let missing = call(ch.clone(), CHARGE, "c1", None, charge("acc", 100))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert!(
        missing.message().contains("requires idempotency-key"),
        "{}",
        missing.message()
    );
    assert_eq!(
        idem_tonic::LayerRefusal::of(&missing),
        Some(idem_tonic::LayerRefusal::KeyMissing)
    );
    let long = "x".repeat(256);
    let invalid = call(ch.clone(), CHARGE, "c1", Some(&long), charge("acc", 100))
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    assert!(
        invalid.message().contains("idempotency-key"),
        "{}",
        invalid.message()
    );
    assert_eq!(
        idem_tonic::LayerRefusal::of(&invalid),
        Some(idem_tonic::LayerRefusal::KeyInvalid)
    );
    // refused before the claim: the handler never ran
    assert_eq!(ledger.runs("acc").len(), 0);
    // Balance is not guarded: no key needed, every call runs.
    for _ in 0..2 {
        let r = call(ch.clone(), BALANCE, "c1", None, charge("bal", 1))
            .await
            .unwrap();
        assert!(!replayed(&r));
    }
    assert_eq!(ledger.runs("bal").len(), 2);
}

/// A scope longer than every store keeps is refused before any claim (a
/// store would fail on it every time); one of the longest length runs.
#[tokio::test]
async fn a_scope_longer_than_the_stores_keep_is_unauthenticated() {
    let store = memory();
    let (addr, ledger) = serve(store.clone(), Policy::default()).await;
    let ch = channel(addr).await;
    let long = "c".repeat(idem_core::MAX_SCOPE_LEN + 1);
    let refused = call(ch.clone(), CHARGE, &long, Some("k"), charge("acc", 5))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert!(
        refused.message().contains("1025 bytes"),
        "{}",
        refused.message()
    );
    assert_eq!(
        idem_tonic::LayerRefusal::of(&refused),
        Some(idem_tonic::LayerRefusal::ScopeTooLong)
    );
    // No scope at all (`MetadataScope`'s metadata empty): refused as well,
    // and said to be the layer's.
    let unscoped = call(ch.clone(), CHARGE, "", Some("k"), charge("acc", 5))
        .await
        .unwrap_err();
    assert_eq!(unscoped.code(), Code::Unauthenticated);
    assert_eq!(
        idem_tonic::LayerRefusal::of(&unscoped),
        Some(idem_tonic::LayerRefusal::ScopeMissing)
    );
    assert_eq!(ledger.runs("acc").len(), 0);
    assert_eq!(store.get(&long, "k").await.unwrap(), None);
    let longest = "c".repeat(idem_core::MAX_SCOPE_LEN);
    let ran = call(ch.clone(), CHARGE, &longest, Some("k"), charge("acc", 5))
        .await
        .unwrap();
    assert!(!replayed(&ran));
    assert_eq!(ledger.runs("acc").len(), 1);
    assert!(store.get(&longest, "k").await.unwrap().is_some());
}

#[tokio::test]
async fn a_call_refused_by_the_check_is_not_stored() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let refused = call(ch.clone(), CHARGE, "c1", Some("k"), charge("acc", 0))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(refused.message(), "amount must be positive");
    // corrected, under the same key: it runs
    let fixed = call(ch.clone(), CHARGE, "c1", Some("k"), charge("acc", 5))
        .await
        .unwrap();
    assert!(!replayed(&fixed));
    assert_eq!(ledger.runs("acc").len(), 1);
}

#[tokio::test]
async fn a_duplicate_while_the_first_runs_is_aborted_with_a_retry_hint() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let first = tokio::spawn(call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("k"),
        charge("slow-1500", 1),
    ));
    // the duplicate arrives while the first surely runs
    while ledger.runs("slow-1500").is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dup = call(ch.clone(), CHARGE, "c1", Some("k"), charge("slow-1500", 1))
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::Aborted);
    assert_eq!(
        idem_tonic::LayerRefusal::of(&dup),
        Some(idem_tonic::LayerRefusal::InFlight)
    );
    let pushback: u64 = dup
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1000..=30_000).contains(&pushback), "{pushback}");
    assert!(dup.metadata().get("retry-after").is_some());
    let first = first.await.unwrap().unwrap();
    let after = call(ch.clone(), CHARGE, "c1", Some("k"), charge("slow-1500", 1))
        .await
        .unwrap();
    assert!(replayed(&after));
    assert_eq!(after.get_ref(), first.get_ref());
    assert_eq!(ledger.runs("slow-1500").len(), 1);
}

#[tokio::test]
async fn unavailable_and_a_panic_release_the_key_and_not_found_is_stored() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let failed = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("u"),
        charge("unavailable-once", 1),
    )
    .await
    .unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable);
    let retried = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("u"),
        charge("unavailable-once", 1),
    )
    .await
    .unwrap();
    assert!(!replayed(&retried), "released: the retry ran");
    let runs = ledger.runs("unavailable-once");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0].0, runs[1].0, "one operation id across the retry");

    let panicked = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("p"),
        charge("panics-once", 1),
    )
    .await
    .unwrap_err();
    assert_eq!(panicked.code(), Code::Internal);
    let retried = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("p"),
        charge("panics-once", 1),
    )
    .await
    .unwrap();
    assert!(!replayed(&retried));
    let runs = ledger.runs("panics-once");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0].0, runs[1].0);

    let missing = call(ch.clone(), CHARGE, "c1", Some("n"), charge("not-found", 1))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert!(missing.metadata().get("idempotent-replayed").is_none());
    let again = call(ch.clone(), CHARGE, "c1", Some("n"), charge("not-found", 1))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::NotFound);
    assert_eq!(again.message(), "no such account");
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(ledger.runs("not-found").len(), 1);
}

/// A method named without its leading slash (`pkg.Svc/Method`) is guarded
/// all the same: before, it never matched, and every call passed through
/// unguarded.
#[tokio::test]
async fn a_method_named_without_its_leading_slash_is_guarded() {
    let layer = IdempotencyLayer::new(
        memory(),
        Policy::default(),
        MetadataScope::new("x-client-id"),
    )
    .unary::<Charge>(CHARGE.trim_start_matches('/'));
    let (addr, ledger) = serve_layer(layer, None).await;
    let ch = channel(addr).await;
    let first = call(ch.clone(), CHARGE, "c1", Some("s"), charge("slashless", 1))
        .await
        .unwrap();
    let again = call(ch.clone(), CHARGE, "c1", Some("s"), charge("slashless", 1))
        .await
        .unwrap();
    assert!(!replayed(&first));
    assert!(replayed(&again), "guarded: the repeat is replayed");
    assert_eq!(ledger.runs("slashless").len(), 1);
}

/// The key sent as binary metadata (`idempotency-key-bin`) is refused
/// (`INVALID_ARGUMENT`), never let through unguarded as a call without a
/// key.
#[tokio::test]
async fn a_key_sent_as_binary_metadata_is_refused() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let mut grpc = tonic::client::Grpc::new(channel(addr).await);
    grpc.ready().await.unwrap();
    let mut request = Request::new(charge("binary-key", 1));
    request
        .metadata_mut()
        .insert("x-client-id", "c1".parse().unwrap());
    request.metadata_mut().insert_bin(
        "idempotency-key-bin",
        tonic::metadata::MetadataValue::from_bytes(b"k"),
    );
    let refused = grpc
        .unary(
            request,
            PathAndQuery::from_static(CHARGE),
            ProstCodec::<Charge, Receipt>::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(
        idem_tonic::LayerRefusal::of(&refused),
        Some(idem_tonic::LayerRefusal::KeyInvalid)
    );
    assert!(ledger.runs("binary-key").is_empty());
}

/// What a handler passes on from calls it made: one of idem's own
/// refusals from a guarded service (in flight), or a server fault
/// (`UNIMPLEMENTED`, `DATA_LOSS`), says nothing final happened and releases
/// the key (over HTTP every `5xx` does); `CANCELLED` (a call cut off, its
/// outcome unknown) keeps it until its lease runs out. None is stored.
#[tokio::test]
async fn statuses_passed_on_release_or_keep_and_are_not_stored() {
    let policy = Policy::builder()
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let (addr, ledger) = serve(memory(), policy).await;
    let ch = channel(addr).await;
    for (account, first_code) in [
        ("passes-in-flight-once", Code::Aborted),
        ("unimplemented-once", Code::Unimplemented),
        ("data-loss-once", Code::DataLoss),
        ("exhausted-once", Code::ResourceExhausted),
    ] {
        let failed = call(ch.clone(), CHARGE, "c1", Some(account), charge(account, 1))
            .await
            .unwrap_err();
        assert_eq!(failed.code(), first_code, "{account}");
        let retried = call(ch.clone(), CHARGE, "c1", Some(account), charge(account, 1))
            .await
            .unwrap_or_else(|e| panic!("{account}: {e:?}"));
        assert!(!replayed(&retried), "{account}: released, the retry ran");
        let runs = ledger.runs(account);
        assert_eq!(runs.len(), 2, "{account}");
        assert_eq!(runs[0].0, runs[1].0, "{account}: one operation id");
    }
    let cancelled = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("cancelled"),
        charge("cancelled-once", 1),
    )
    .await
    .unwrap_err();
    assert_eq!(cancelled.code(), Code::Cancelled);
    let held = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("cancelled"),
        charge("cancelled-once", 1),
    )
    .await
    .unwrap_err();
    assert_eq!(held.code(), Code::Aborted, "kept: in flight, {held:?}");
    assert_eq!(
        idem_tonic::LayerRefusal::of(&held),
        Some(idem_tonic::LayerRefusal::InFlight)
    );
    assert_eq!(ledger.runs("cancelled-once").len(), 1);
}

/// A service whose `RESOURCE_EXHAUSTED` is the call's final answer (a
/// quota spent) tells the policy to store `429`: it is replayed.
#[tokio::test]
async fn a_policy_that_stores_429_stores_resource_exhausted() {
    let policy = Policy::builder().store_client_error(429).build().unwrap();
    let (addr, ledger) = serve(memory(), policy).await;
    let ch = channel(addr).await;
    let account = "exhausted-once";
    let first = call(ch.clone(), CHARGE, "c1", Some("q"), charge(account, 1))
        .await
        .unwrap_err();
    assert_eq!(first.code(), Code::ResourceExhausted);
    let again = call(ch.clone(), CHARGE, "c1", Some("q"), charge(account, 1))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::ResourceExhausted);
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(ledger.runs(account).len(), 1);
}

/// A handler that cannot know its outcome (`keep_claim`) leaves the key
/// held whatever it answers, even a status that would release it, and
/// even when it panics: a retry is `ABORTED` until the lease runs out, then
/// takes the key over under the same operation id. `settle_by_answer`
/// undoes it; `release_claim` frees the key whatever the status (a status
/// that would be stored); `abandon` neither stores nor releases.
#[tokio::test]
async fn a_handler_keeps_releases_or_abandons_its_claim() {
    let lease = Duration::from_millis(1500);
    let policy = Policy::builder().lease(lease).build().unwrap();
    let (addr, ledger) = serve(memory(), policy).await;
    let ch = channel(addr).await;
    let send =
        |account: &'static str| call(ch.clone(), CHARGE, "c1", Some(account), charge(account, 1));

    for (account, first) in [
        ("unknown-once", Code::Unavailable),
        ("unknown-panics-once", Code::Unavailable),
        ("lost-once", Code::Aborted),
    ] {
        let failed = send(account).await.unwrap_err();
        assert_eq!(failed.code(), first, "{account}: {failed:?}");
        // Held: neither stored nor released.
        let held = send(account).await.unwrap_err();
        assert_eq!(held.code(), Code::Aborted, "{account}: {held:?}");
        assert!(held.message().contains("in flight"), "{account}: {held:?}");
        assert_eq!(ledger.runs(account).len(), 1, "{account}");
    }
    // After the lease, each is taken over under the same operation id.
    tokio::time::sleep(lease).await;
    for account in ["unknown-once", "unknown-panics-once", "lost-once"] {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let took_over = loop {
            match send(account).await {
                Err(s) if s.code() == Code::Aborted && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                other => break other.unwrap(),
            }
        };
        assert!(!replayed(&took_over), "{account}");
        let runs = ledger.runs(account);
        assert_eq!(runs.len(), 2, "{account}");
        assert_eq!(runs[0].0, runs[1].0, "{account}: one operation id");
        let left: u64 = took_over
            .metadata()
            .get("x-lease-left-ms")
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(left > 0 && left <= 1500, "{account}: {left} ms left");
    }

    // Kept, then settled by the answer: UNAVAILABLE releases as usual.
    let failed = send("known-after-all-once").await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable);
    let ran = send("known-after-all-once").await.unwrap();
    assert!(!replayed(&ran));
    assert_eq!(ledger.runs("known-after-all-once").len(), 2);

    // Released whatever the status: RESOURCE_EXHAUSTED, stored otherwise.
    let limited = send("rate-limited-once").await.unwrap_err();
    assert_eq!(limited.code(), Code::ResourceExhausted);
    let ran = send("rate-limited-once").await.unwrap();
    assert!(!replayed(&ran));
    let again = send("rate-limited-once").await.unwrap();
    assert!(replayed(&again), "the answer after the release is stored");
    assert_eq!(ledger.runs("rate-limited-once").len(), 2);
}

#[tokio::test]
async fn a_compressed_message_is_the_same_call_as_a_plain_one() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let plain = call(ch.clone(), CHARGE, "c1", Some("z"), charge("gz", 7))
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(ch.clone())
        .send_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Gzip);
    let zipped = call_on(
        &mut grpc,
        CHARGE,
        "c1",
        Some(Key::Metadata("z")),
        charge("gz", 7),
    )
    .await
    .unwrap();
    assert!(replayed(&zipped));
    assert_eq!(zipped.get_ref(), plain.get_ref());
    // and a gzip-accepting first call stores an answer any client reads
    let first = call_on(
        &mut grpc,
        CHARGE,
        "c1",
        Some(Key::Metadata("z2")),
        charge("gz2", 7),
    )
    .await
    .unwrap();
    let plain = call(ch.clone(), CHARGE, "c1", Some("z2"), charge("gz2", 7))
        .await
        .unwrap();
    assert!(replayed(&plain));
    assert_eq!(plain.get_ref(), first.get_ref());
    assert_eq!(ledger.runs("gz").len() + ledger.runs("gz2").len(), 2);
}

/// One raw call on `ch`: a message frame as given (`flag` its compression
/// flag) with `grpc-encoding: encoding`; the answer's `grpc-status` and
/// whether it was replayed.
async fn raw_call(
    ch: &Channel,
    key: &str,
    encoding: &str,
    flag: u8,
    message: Vec<u8>,
) -> (String, bool) {
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://idem.test{CHARGE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-encoding", encoding)
        .header("x-client-id", "c1")
        .header("idempotency-key", key)
        .body(framed(flag, &message))
        .unwrap();
    let answer = tower::ServiceExt::oneshot(ch.clone(), request)
        .await
        .unwrap();
    status_of(answer).await
}

/// `message` as one gRPC frame (`flag` its compression flag), as a body.
fn framed(flag: u8, message: &[u8]) -> Body {
    let mut frame = vec![flag];
    frame.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(message);
    Body::new(http_body_util::Full::new(bytes::Bytes::from(frame)))
}

/// An encoding the layer reads but the service does not accept (the bank
/// takes gzip alone): the service gets the message uncompressed, so the
/// call runs, and its answer is what a retry in any encoding replays. A
/// `grpc-encoding` on an uncompressed frame (as gRPC's C core sends when
/// compressing would not shrink a message) likewise. Neither refusal is
/// stored.
#[tokio::test]
async fn an_encoding_the_service_does_not_accept_still_runs_once() {
    use std::io::Write;
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let ch = channel(addr).await;
    let message = prost::Message::encode_to_vec(&charge("deflated", 5));
    let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    zlib.write_all(&message).unwrap();
    let deflated = zlib.finish().unwrap();
    assert_eq!(
        raw_call(&ch, "df-1", "deflate", 1, deflated.clone()).await,
        ("0".to_owned(), false)
    );
    assert_eq!(
        raw_call(&ch, "df-1", "deflate", 1, deflated).await,
        ("0".to_owned(), true)
    );
    let plain = call(
        ch.clone(),
        CHARGE,
        "c1",
        Some("df-1"),
        charge("deflated", 5),
    )
    .await
    .unwrap();
    assert!(replayed(&plain));
    assert_eq!(ledger.runs("deflated").len(), 1);
    let message = prost::Message::encode_to_vec(&charge("flagless", 5));
    assert_eq!(
        raw_call(&ch, "df-2", "zstd", 0, message).await,
        ("0".to_owned(), false)
    );
    assert_eq!(ledger.runs("flagless").len(), 1);
}

/// Racing duplicates on PostgreSQL: one run, every answer the same.
#[tokio::test]
async fn racing_duplicates_run_once_on_postgres() {
    use idem_test_support::postgres::{database_url, TestSchema};
    let schema = TestSchema::create("idem_tonic").await;
    let table = idem_postgres::TableName::new(Some(schema.name()), "idem_records").unwrap();
    let store = idem_postgres::PostgresStore::connect_with(&database_url(), table)
        .await
        .unwrap();
    let policy = Policy::builder()
        .wait_for_in_flight(Duration::from_secs(20))
        .build()
        .unwrap();
    let (addr, ledger) = serve(Arc::new(store), policy).await;
    let ch = channel(addr).await;
    for round in 0..5 {
        let account = format!("slow-{}", 20 * round);
        let key: &'static str = Box::leak(format!("race-{round}").into_boxed_str());
        let calls: Vec<_> = (0..12)
            .map(|_| {
                tokio::spawn(call(
                    ch.clone(),
                    CHARGE,
                    "c1",
                    Some(key),
                    charge(&account, 9),
                ))
            })
            .collect();
        let mut answers = Vec::new();
        for c in calls {
            answers.push(c.await.unwrap().unwrap());
        }
        assert_eq!(ledger.runs(&account).len(), 1, "round {round}");
        let fresh = answers.iter().filter(|a| !replayed(a)).count();
        assert_eq!(fresh, 1, "round {round}");
        assert!(answers.iter().all(|a| a.get_ref() == answers[0].get_ref()));
    }
}

#[tokio::test]
async fn the_client_layer_keeps_one_key_across_retries() {
    let (addr, ledger) = serve(memory(), Policy::default()).await;
    let retrying = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::builder()
                .method(CHARGE)
                .base_delay(Duration::from_millis(10))
                .build(),
        )
        .service(channel(addr).await);
    // UNAVAILABLE the first time: retried under the key it generated
    let r = call(
        retrying.clone(),
        CHARGE,
        "c1",
        None,
        charge("unavailable-once", 3),
    )
    .await
    .unwrap();
    let runs = ledger.runs("unavailable-once");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0].1, runs[1].1, "one key");
    assert_eq!(runs[0].0, runs[1].0, "one operation");
    let outcome = r.extensions().get::<RetryOutcome>().unwrap();
    assert_eq!(outcome.attempts, 2);
    assert_eq!(outcome.key, runs[0].1);
    assert!(!outcome.replayed);

    // ABORTED while the first attempt runs: waits for it, then gets the replay
    let first = tokio::spawn(call(
        retrying.clone(),
        CHARGE,
        "c1",
        Some("slow"),
        charge("slow-800", 1),
    ));
    while ledger.runs("slow-800").is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut grpc = tonic::client::Grpc::new(retrying.clone());
    let dup = call_on(
        &mut grpc,
        CHARGE,
        "c1",
        Some(Key::Intent("slow")),
        charge("slow-800", 1),
    )
    .await
    .unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(dup.get_ref(), first.get_ref());
    let outcome = dup.extensions().get::<RetryOutcome>().unwrap();
    assert!(outcome.attempts >= 2, "{outcome:?}");
    assert!(outcome.replayed);
    assert_eq!(outcome.key, "slow");
    assert_eq!(ledger.runs("slow-800").len(), 1);

    // a stored ABORTED of the handler's own: the first call's retry gets its
    // replay and stops there (not after the 35 s budget), as does a repeat
    let mut grpc = tonic::client::Grpc::new(retrying.clone());
    let started = std::time::Instant::now();
    for _ in 0..2 {
        let r = call_on(
            &mut grpc,
            CHARGE,
            "c1",
            Some(Key::Intent("conflicted")),
            charge("conflicted", 1),
        )
        .await
        .unwrap_err();
        assert_eq!(r.code(), Code::Aborted);
        assert_eq!(r.message(), "the handler's own conflict");
        assert_eq!(r.metadata().get("idempotent-replayed").unwrap(), "true");
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(ledger.runs("conflicted").len(), 1);

    // a status retrying cannot fix comes back at once
    let r = call(retrying.clone(), CHARGE, "c1", None, charge("not-found", 3))
        .await
        .unwrap_err();
    assert_eq!(r.code(), Code::NotFound);
    assert_eq!(ledger.runs("not-found").len(), 1);
}

/// A server whose own time limit (`Server::timeout`, outside the layer)
/// cuts a slow call answers `CANCELLED` while the handler goes on: the
/// client layer sends the call again under its key, waits out the call in
/// flight, and gets its answer, run once.
#[tokio::test]
async fn the_client_layer_retries_a_call_the_servers_time_limit_cancelled() {
    let (addr, ledger) = serve_with_limit(
        memory(),
        Policy::default(),
        Some(Duration::from_millis(200)),
    )
    .await;
    let retrying = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::builder()
                .method(CHARGE)
                .base_delay(Duration::from_millis(10))
                .build(),
        )
        .service(channel(addr).await);
    let r = call(retrying, CHARGE, "c1", None, charge("slow-600", 5))
        .await
        .unwrap();
    assert_eq!(ledger.runs("slow-600").len(), 1, "run once");
    let outcome = r.extensions().get::<RetryOutcome>().unwrap();
    assert!(outcome.attempts >= 2, "{outcome:?}");
    assert!(outcome.replayed, "{outcome:?}");
}

#[tokio::test]
async fn the_client_layer_does_not_resend_a_message_over_the_limit() {
    let policy = Policy::builder().max_body(16).build().unwrap();
    let (addr, ledger) = serve(memory(), policy).await;
    let sent = Arc::new(AtomicUsize::new(0));
    let counted = {
        let sent = sent.clone();
        tower::ServiceBuilder::new()
            .map_request(move |r: http::Request<Body>| {
                sent.fetch_add(1, Ordering::SeqCst);
                r
            })
            .service(channel(addr).await)
    };
    let retrying = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::builder()
                .method(CHARGE)
                .base_delay(Duration::from_millis(10))
                .build(),
        )
        .service(counted);
    let too_large = call(retrying, CHARGE, "c1", None, charge(&"x".repeat(64), 1))
        .await
        .unwrap_err();
    assert_eq!(too_large.code(), Code::ResourceExhausted, "{too_large:?}");
    // Sent once: the same message meets the same limit every time.
    assert_eq!(sent.load(Ordering::SeqCst), 1);
    assert!(ledger.runs(&"x".repeat(64)).is_empty());
}

/// A port nothing listens on (bound, then let go), and a channel to it
/// that connects on first use: every attempt is refused.
fn refusing_channel() -> (std::net::SocketAddr, Channel) {
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    (addr, channel)
}

/// An empty call of the charge method to `addr`, with intent key `key`.
fn charge_request(addr: std::net::SocketAddr, key: &str) -> http::Request<Body> {
    let mut request = http::Request::new(Body::empty());
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = format!("http://{addr}{CHARGE}").parse().unwrap();
    request.extensions_mut().insert(IntentKey::new(key));
    request
}

#[tokio::test]
async fn the_client_layer_gives_up_with_the_key_it_used() {
    let (addr, channel) = refusing_channel();
    let mut retrying = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::builder()
                .method(CHARGE)
                .base_delay(Duration::from_millis(10))
                .max_elapsed(Duration::from_millis(300))
                .build(),
        )
        .service(channel);
    let request = charge_request(addr, "gone");
    use tower::{Service, ServiceExt};
    let err = retrying
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    let err = err.downcast::<RetryError>().unwrap();
    assert_eq!(err.key, "gone");
    assert!(err.attempts >= 2, "{err}");
    assert!(
        err.to_string().contains("under idempotency-key \"gone\""),
        "{err}"
    );
}

/// The caller's deadline (`grpc-timeout`) bounds the retries: a call made
/// with 400 ms to a port that refuses it gives up with its deadline, not
/// after the layer's 35 s, and each attempt after the first is sent with
/// the time left, less each time.
#[tokio::test]
async fn the_client_layer_keeps_to_the_callers_deadline() {
    let (addr, channel) = refusing_channel();
    let sent = Arc::new(Mutex::new(Vec::<String>::new()));
    let recorded = {
        let sent = sent.clone();
        tower::ServiceBuilder::new()
            .map_request(move |r: http::Request<Body>| {
                let timeout = r
                    .headers()
                    .get("grpc-timeout")
                    .map(|v| v.to_str().unwrap().to_owned());
                sent.lock().unwrap().push(timeout.unwrap_or_default());
                r
            })
            .service(channel)
    };
    let mut retrying = tower::ServiceBuilder::new()
        .layer(
            IdempotentRetryLayer::builder()
                .method(CHARGE)
                .base_delay(Duration::from_millis(20))
                .build(),
        )
        .service(recorded);
    let mut request = charge_request(addr, "in-time");
    request
        .headers_mut()
        .insert("grpc-timeout", http::HeaderValue::from_static("400m"));
    use tower::{Service, ServiceExt};
    let started = std::time::Instant::now();
    let err = retrying
        .ready()
        .await
        .unwrap()
        .call(request)
        .await
        .unwrap_err();
    let took = started.elapsed();
    let err = err.downcast::<RetryError>().unwrap();
    assert_eq!(err.key, "in-time");
    assert!(took < Duration::from_secs(5), "gave up after {took:?}");
    let sent = sent.lock().unwrap().clone();
    assert!(sent.len() >= 2, "{sent:?}");
    assert_eq!(
        sent[0], "400m",
        "the first attempt goes as the caller sent it"
    );
    let micros: Vec<u64> = sent[1..]
        .iter()
        .map(|v| v.strip_suffix('u').unwrap().parse().unwrap())
        .collect();
    assert!(micros.iter().all(|&us| us < 400_000), "{sent:?}");
    assert!(micros.windows(2).all(|w| w[1] < w[0]), "{sent:?}");
}

/// A request for the layer itself (no network): `Charge` for `account`,
/// client `c1`, under `key`.
fn layer_request(key: &str, account: &str) -> http::Request<Body> {
    use prost::Message as _;
    http::Request::builder()
        .method("POST")
        .uri(format!("http://idem.test{CHARGE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-client-id", "c1")
        .header("idempotency-key", key)
        .body(framed(0, &charge(account, 1).encode_to_vec()))
        .unwrap()
}

/// The `grpc-status` an answer of the layer's carries (in its head, or
/// its trailers), and whether it is a replay.
async fn status_of(answer: http::Response<Body>) -> (String, bool) {
    use http_body_util::BodyExt;
    let replayed = answer.headers().get("idempotent-replayed").is_some();
    let head = answer.headers().get("grpc-status").cloned();
    let collected = answer.into_body().collect().await.unwrap();
    let status = head
        .or_else(|| {
            collected
                .trailers()
                .and_then(|t| t.get("grpc-status").cloned())
        })
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, replayed)
}

/// The handler answered and its answer's body then failed: in gRPC the
/// status comes after the message, so the outcome is unknown. The claim
/// stays until its lease runs out (released, the client's retry of
/// `UNAVAILABLE` ran the handler again at once, beside an effect that may
/// be done), then a retry takes it over under the same operation id. A
/// head that already named a status that is not stored releases, as it
/// would whole.
#[tokio::test]
async fn an_answer_whose_body_fails_keeps_the_claim_for_its_lease() {
    use http_body_util::StreamBody;
    use tower::{Layer as _, ServiceExt as _};
    let lease = Duration::from_millis(1500);
    let policy = Policy::builder().lease(lease).build().unwrap();
    let layer = IdempotencyLayer::new(memory(), policy, MetadataScope::new("x-client-id"))
        .unary::<Charge>(CHARGE);
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let service = layer.layer(tower::service_fn({
        let runs = runs.clone();
        move |request: http::Request<Body>| {
            let runs = runs.clone();
            async move {
                let idem = request.extensions().get::<Idempotency>().unwrap();
                runs.lock().unwrap().push(idem.operation_id().to_string());
                let mut head = http::Response::builder().header("content-type", "application/grpc");
                if idem.key().ends_with("named-unavailable") {
                    head = head.header("grpc-status", "14");
                }
                let panics = idem.key().ends_with("panicking");
                let frames = [
                    Ok(http_body::Frame::data(bytes::Bytes::from_static(
                        b"\0\0\0\0\0",
                    ))),
                    Err(std::io::Error::other(
                        "the connection to the downstream reset",
                    )),
                ]
                .into_iter()
                .enumerate()
                .map(move |(i, frame)| {
                    // A stream with a bug, as a body or a store's driver
                    // may have: a panic where the failure was.
                    assert!(!(panics && i == 1), "the answer panicked on purpose");
                    frame
                });
                Ok::<_, Infallible>(
                    head.body(StreamBody::new(tokio_stream::iter(frames)))
                        .unwrap(),
                )
            }
        }
    }));
    let send = |key: &str| service.clone().oneshot(layer_request(key, "acc"));

    let started = std::time::Instant::now();
    let (first, _) = status_of(send("broken").await.unwrap()).await;
    assert_eq!(first, "14", "UNAVAILABLE: the outcome is unknown");
    let (held, _) = status_of(send("broken").await.unwrap()).await;
    assert!(
        started.elapsed() < lease,
        "the machine stalled past the case's margin"
    );
    assert_eq!(held, "10", "ABORTED while held; released, it ran again");
    assert_eq!(runs.lock().unwrap().len(), 1);
    tokio::time::sleep(lease.saturating_sub(started.elapsed()) + Duration::from_millis(50)).await;
    let (again, _) = status_of(send("broken").await.unwrap()).await;
    assert_eq!(again, "14");
    {
        let runs = runs.lock().unwrap();
        assert_eq!(runs.len(), 2, "taken over after the lease");
        assert_eq!(runs[0], runs[1], "under the same operation id");
    }

    // A panic in its place keeps the claim the same way.
    let started = std::time::Instant::now();
    let (first, _) = status_of(send("panicking").await.unwrap()).await;
    assert_eq!(first, "14", "UNAVAILABLE: the outcome is unknown");
    let (held, _) = status_of(send("panicking").await.unwrap()).await;
    assert!(
        started.elapsed() < lease,
        "the machine stalled past the case's margin"
    );
    assert_eq!(held, "10", "ABORTED while held; released, it ran again");
    assert_eq!(runs.lock().unwrap().len(), 3);

    // A head naming UNAVAILABLE already: released, the retry runs at once.
    let (first, _) = status_of(send("named-unavailable").await.unwrap()).await;
    assert_eq!(first, "13");
    let (second, _) = status_of(send("named-unavailable").await.unwrap()).await;
    assert_eq!(second, "13", "ran again, not held");
    assert_eq!(runs.lock().unwrap().len(), 5);
}

/// A caller that gives up (its deadline, a disconnect) while its claim's
/// answer is on the way back: the claim was made, and the call goes on
/// without the caller (the handler runs, its answer is stored), so the
/// retry gets the replay. Dropped with the caller, the claim held the key
/// for a lease (30 s) with no handler.
#[tokio::test]
async fn a_caller_gone_while_its_claim_is_answered_still_gets_its_answer_stored() {
    use tower::{Layer as _, ServiceExt as _};
    let store: Arc<dyn Store> = Arc::new(idem_test_support::stores::SlowClaimAnswers {
        inner: idem_memory::MemoryStore::new(),
        delay: Duration::from_millis(300),
    });
    let layer = IdempotencyLayer::new(store, Policy::default(), MetadataScope::new("x-client-id"))
        .unary::<Charge>(CHARGE);
    let ledger = Arc::new(Ledger::default());
    let service = layer.layer(Bank(ledger.clone()));
    let gone = tokio::time::timeout(
        Duration::from_millis(100),
        service.clone().oneshot(layer_request("k-gone", "gone")),
    )
    .await;
    assert!(gone.is_err(), "the caller gave up first");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ledger.runs("gone").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the handler never ran: the claim was dropped with the caller"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = loop {
        let answer = service
            .clone()
            .oneshot(layer_request("k-gone", "gone"))
            .await
            .unwrap();
        let (status, replayed) = status_of(answer).await;
        if status != "10" {
            break (status, replayed);
        }
        assert!(std::time::Instant::now() < deadline, "still in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(replay, ("0".to_owned(), true));
    assert_eq!(ledger.runs("gone").len(), 1);
}

/// A server whose pushback is negative or unreadable says not to come
/// back (gRPC's retry design, A6): the client layer returns its answer
/// after one attempt; a readable one is waited out and retried.
#[tokio::test]
async fn the_client_layer_stops_when_the_pushback_says_so() {
    use tower::ServiceExt as _;
    for (pushback, attempts) in [("-1", 1), ("later", 1), ("5", 3)] {
        let sent = Arc::new(AtomicUsize::new(0));
        let server = tower::service_fn({
            let sent = sent.clone();
            move |_: http::Request<Body>| {
                sent.fetch_add(1, Ordering::SeqCst);
                async move {
                    Ok::<_, Infallible>(
                        http::Response::builder()
                            .header("content-type", "application/grpc")
                            .header("grpc-status", "14")
                            .header("grpc-retry-pushback-ms", pushback)
                            .body(Body::empty())
                            .unwrap(),
                    )
                }
            }
        });
        let retrying = tower::ServiceBuilder::new()
            .layer(
                IdempotentRetryLayer::builder()
                    .method(CHARGE)
                    .base_delay(Duration::from_millis(5))
                    .max_attempts(3)
                    .build(),
            )
            .service(server);
        let answer = retrying
            .oneshot(charge_request(
                "127.0.0.1:1".parse().unwrap(),
                "pushed-back",
            ))
            .await
            .unwrap();
        assert_eq!(answer.headers()["grpc-status"], "14", "{pushback}");
        assert_eq!(sent.load(Ordering::SeqCst), attempts, "{pushback}");
    }
}
