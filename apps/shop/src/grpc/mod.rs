//! shop's gRPC API (`--grpc-listen`): `shop.v1.Payments`
//! (`proto/shop.proto`), the same payments as `POST /payments` and
//! `GET /payments/{id}`, on the same database and bank.
//!
//! `CreatePayment` is guarded by idem's gRPC layer over the same records
//! store as the HTTP API: the same key rules, the validation before the
//! claim (nothing stored for a call that cannot run), the bank charged
//! under the claim's operation id, the payment recorded once per
//! operation id.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::request::Parts;
use idem_core::{Policy, Store};
use idem_tonic::{Idempotency, IdempotencyLayer};
use tonic::{Request, Response, Status};
use tracing::info;

use crate::db::{self, Payment, PAYMENT_COLUMNS};
use crate::http::auth::client_id;
use crate::http::payments::{self, KeyOf, NewPayment, Route, Simulate, SimulateOn};
use crate::http::{input, AppState};

mod limits;
#[allow(
    missing_docs,
    unreachable_pub,
    dead_code,
    missing_debug_implementations,
    clippy::all
)]
pub(crate) mod pb;

use pb::payments_server::{Payments, PaymentsServer};

/// The guarded method's path.
const CREATE_PAYMENT: &str = "/shop.v1.Payments/CreatePayment";

/// The tenant of a call: `authorization: Bearer <client>`, as over HTTP.
fn tenant(parts: &Parts) -> Result<String, Status> {
    client_id(&parts.headers).map_err(crate::http::error::Error::into_status)
}

impl KeyOf for Idempotency {
    fn operation(&self) -> idem_core::OperationId {
        self.operation_id()
    }
    fn client(&self) -> &str {
        self.scope()
    }
    fn idempotency_key(&self) -> &str {
        self.key()
    }
    fn release(&self) {
        self.release_claim();
    }
    fn token(&self) -> idem_core::FencingToken {
        Idempotency::token(self)
    }
}

/// `shop.v1.Payments`.
#[derive(Debug, Clone)]
struct PaymentsApi {
    state: AppState,
}

#[tonic::async_trait]
impl Payments for PaymentsApi {
    async fn create_payment(
        &self,
        request: Request<pb::CreatePaymentRequest>,
    ) -> Result<Response<pb::Payment>, Status> {
        let (metadata, extensions, message) = request.into_parts();
        let headers = metadata.into_headers();
        let client = client_id(&headers).map_err(|e| e.into_status())?;
        let Some(idem) = extensions.get::<Idempotency>() else {
            return Err(Status::internal(
                "CreatePayment ran without its idempotency claim",
            ));
        };
        let simulate = Simulate::parse(&headers, self.state.fault_injection, SimulateOn::Payment)
            .map_err(|e| e.into_status())?;
        let new = new_payment(message);
        new.check().map_err(|e| e.into_status())?;
        let operation_id = payments::bound_operation(&self.state, idem, Route::Grpc, &new)
            .await
            .map_err(|e| e.into_status())?;
        let charged = payments::charge_new(&self.state, &client, operation_id, &simulate, new)
            .await
            .map_err(|e| e.into_status())?;
        let recorded = payments::record_payment_alone(&self.state, &client, operation_id, &charged)
            .await
            .map_err(|e| e.into_status())?;
        Ok(Response::new(to_message(
            recorded,
            operation_id.to_string(),
        )))
    }

    async fn get_payment(
        &self,
        request: Request<pb::GetPaymentRequest>,
    ) -> Result<Response<pb::Payment>, Status> {
        let client =
            client_id(&request.metadata().clone().into_headers()).map_err(|e| e.into_status())?;
        let id = request.into_inner().id;
        input::identifier("the payment id", &id).map_err(|e| e.into_status())?;
        let sql = format!(
            "SELECT {PAYMENT_COLUMNS}, operation_id FROM shop_payments WHERE id = $1 AND client_id = $2"
        );
        let row = db::query_one(&*self.state.db, &sql, &[(&id).into(), (&client).into()])
            .await
            .map_err(|e| crate::http::error::Error::Database(e).into_status())?;
        let Some(row) = row else {
            return Err(Status::not_found(format!("no payment {id:?}")));
        };
        let read = Payment::try_from(&row).and_then(|p| Ok((p, row.text("operation_id")?)));
        let (payment, operation_id) =
            read.map_err(|e| crate::http::error::Error::Database(e).into_status())?;
        Ok(Response::new(to_message(payment, operation_id)))
    }
}

/// The payment a `CreatePaymentRequest` asks for.
fn new_payment(message: pb::CreatePaymentRequest) -> NewPayment {
    NewPayment {
        account_id: message.account_id,
        amount: message.amount,
        currency: message.currency,
    }
}

/// A payment as its message.
fn to_message(payment: Payment, operation_id: String) -> pb::Payment {
    pb::Payment {
        id: payment.id,
        account_id: payment.account_id,
        amount: payment.amount,
        currency: payment.currency,
        status: payment.status,
        operation_id,
    }
}

/// The payments service behind idem's gRPC layer over `store`: what a
/// call cannot run with (a bad tenant, bounds, `x-simulate` past what
/// `--fault-injection` allows) is refused before the claim.
/// Calls cancelled mid-way leave their handlers running (to store their
/// answers); with at most `max_running` guarded calls and requests running
/// at once (the connection cap), a client cannot pile them up by opening
/// and cancelling calls on one connection.
fn layer(
    state: &AppState,
    store: Arc<dyn Store>,
    policy: Policy,
    max_running: usize,
) -> IdempotencyLayer {
    let allowed = state.fault_injection;
    IdempotencyLayer::new(store, policy, tenant)
        .unary_checked(
            CREATE_PAYMENT,
            move |parts: &Parts, message: &pb::CreatePaymentRequest| {
                Simulate::parse(&parts.headers, allowed, SimulateOn::Payment)
                    .and_then(|_| new_payment(message.clone()).check())
                    .map_err(|e| e.into_status())
            },
        )
        .max_running(max_running)
}

/// The most calls one gRPC connection may have open at once (HTTP/2's
/// `SETTINGS_MAX_CONCURRENT_STREAMS`, the least RFC 9113 recommends); a
/// client opens more connections, or waits, for more.
pub(crate) const MAX_CONCURRENT_STREAMS: u32 = 100;

/// Serves `shop.v1.Payments` on `listener` until `shutdown` completes,
/// within the HTTP server's `limits` (see [`limits`]; `main` bounds the
/// drain by their grace).
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    store: Arc<dyn Store>,
    policy: Policy,
    limits: idem_axum::serve::Limits,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    info!(?addr, "gRPC ready");
    // A message is read whole before it is decoded: no larger than an HTTP
    // body may be, on every method (tonic's own default is 4 MiB).
    let max_message = policy.max_body();
    let layer = layer(&state, store, policy, limits.max_connections);
    // A body that stalls between two chunks, or trickles in below the
    // minimum rate, fails its call (as over HTTP), before the idempotency
    // layer has claimed anything.
    let stalls = tower::ServiceBuilder::new()
        .layer(idem_axum::serve::MinRateLayer::new(
            limits.body_timeout,
            limits.body_min_rate,
        ))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            limits.body_timeout,
        ))
        .map_request(
            |r: http::Request<
                tower_http::timeout::TimeoutBody<idem_axum::serve::MinRateBody<tonic::body::Body>>,
            >| r.map(tonic::body::Body::new),
        );
    tonic::transport::Server::builder()
        // A peer that stops answering is found out and dropped.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        // Calls open at once on one connection: without a cap (tonic sets
        // none, which lifts hyper's), one connection could open thousands
        // and hold every database connection the pool has.
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .layer(stalls)
        .layer(layer)
        // gzip, which the idempotency layer reads too: a compressed call is
        // the same call as a plain one.
        .add_service(
            PaymentsServer::new(PaymentsApi { state })
                .accept_compressed(tonic::codec::CompressionEncoding::Gzip)
                .max_decoding_message_size(max_message),
        )
        .serve_with_incoming_shutdown(
            limits::capped(listener, limits.max_connections, limits.header_timeout),
            shutdown,
        )
        .await
}
