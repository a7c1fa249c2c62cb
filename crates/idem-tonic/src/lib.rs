//! The gRPC edge of idem: a tower layer that makes chosen **unary methods
//! of a tonic server** safe to retry, and a client layer that keeps one
//! key per intent across retries.
//!
//! gRPC retries on its own (the retry and hedging policies of proposal A6
//! send the same call twice on purpose), and `idempotency_level` in a
//! `.proto` only *says* a method is safe to repeat. With this layer, a call
//! sent with `idempotency-key` metadata runs once per key; every repeat
//! gets the first answer.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::{atomic::{AtomicUsize, Ordering}, Arc};
//! use idem_tonic::{IdempotencyLayer, MetadataScope};
//! use tonic::body::Body;
//! use tower::{Layer, ServiceExt};
//!
//! /// The request message of the guarded method.
//! #[derive(Clone, PartialEq, prost::Message)]
//! struct CreatePayment {
//!     #[prost(int64, tag = "1")]
//!     amount: i64,
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let layer = IdempotencyLayer::new(
//!     Arc::new(idem_memory::MemoryStore::new()),
//!     Default::default(),
//!     MetadataScope::new("x-client-id"),
//! )
//! .unary::<CreatePayment>("/shop.v1.Payments/CreatePayment");
//!
//! // In a service: `Server::builder().layer(layer).add_service(PaymentsServer::new(payments))`.
//! // Here a stand-in for the server counts how many times it runs.
//! let runs = Arc::new(AtomicUsize::new(0));
//! let counted = runs.clone();
//! let server = layer.layer(tower::service_fn(move |_: http::Request<Body>| {
//!     counted.fetch_add(1, Ordering::SeqCst);
//!     async { Ok::<_, Infallible>(tonic::Status::ok("").into_http::<Body>()) }
//! }));
//!
//! // CreatePayment { amount: 100 } as one gRPC frame, twice under one key.
//! let call = || {
//!     http::Request::post("/shop.v1.Payments/CreatePayment")
//!         .header("content-type", "application/grpc")
//!         .header("x-client-id", "acme")
//!         .header("idempotency-key", "order-42-payment")
//!         .body(Body::new(http_body_util::Full::new(bytes::Bytes::from_static(
//!             b"\0\0\0\0\x02\x08\x64",
//!         ))))
//!         .unwrap()
//! };
//! let first = server.clone().oneshot(call()).await.unwrap();
//! let again = server.clone().oneshot(call()).await.unwrap();
//! assert!(first.headers().get("idempotent-replayed").is_none());
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! assert_eq!(runs.load(Ordering::SeqCst), 1);
//! # }
//! ```
//!
//! # The contract
//!
//! For each method named with [`IdempotencyLayer::unary`] (others pass
//! through untouched):
//!
//! - The key is the `idempotency-key` metadata, with the HTTP header's
//!   rules (1 to 255 visible ASCII characters, sent once). Missing where the
//!   policy requires it, or invalid: `INVALID_ARGUMENT`; so is a key sent
//!   as binary metadata (`idempotency-key-bin`), which is not read.
//! - The scope comes from a [`ScopeExtractor`] (metadata set by your
//!   authentication, the authenticated peer); keys of one scope are never
//!   seen by another.
//! - The fingerprint is the method's path and the request message,
//!   decompressed (`gzip`, `deflate`) and decoded as the method's message
//!   type, then encoded again: the same message sent compressed or not, in
//!   another field order, with a default value written out or not, is the
//!   same call. A message that does not decode is `INVALID_ARGUMENT`; one
//!   larger than the policy's `max_body` is `RESOURCE_EXHAUSTED`; another
//!   compression is `UNIMPLEMENTED`; nothing is claimed for any of them.
//! - A duplicate while the first runs is `ABORTED`, with the standard
//!   `grpc-retry-pushback-ms` metadata (and `retry-after` in seconds); or,
//!   with [`Policy::builder`](idem_core::Policy::builder)'s
//!   `wait_for_in_flight`, it waits (bounded) for the first answer.
//! - The key reused with another message or method: `FAILED_PRECONDITION`.
//! - A replay sends the stored status, message, details and the metadata
//!   and trailers named by [`IdempotencyLayer::replay_metadata`], marked
//!   `idempotent-replayed: true`. Answers are stored uncompressed, so that
//!   a replay reads for any client.
//! - `UNAVAILABLE`, `INTERNAL`, `UNKNOWN`, `DEADLINE_EXCEEDED`, the
//!   server's faults `UNIMPLEMENTED` and `DATA_LOSS` (as every `5xx` over
//!   HTTP) and a panic release the claim: the retry runs again, under the
//!   same operation id. So does one of idem's own refusals that a handler
//!   passes on from a service it called (in flight, store unavailable,
//!   handler failed, message unreadable: nothing a replay should give).
//!   `RESOURCE_EXHAUSTED` (HTTP's `429`: a rate limit, a quota) releases
//!   too, unless the policy stores `429`
//!   ([`PolicyBuilder::store_client_error`](idem_core::PolicyBuilder::store_client_error)).
//!   `CANCELLED` (a call the handler made was cut off, its outcome
//!   unknown) keeps the claim until its lease runs out. Every other status
//!   is stored and replayed (with a policy that does not store client
//!   errors, only `OK` is).
//! - An answer whose body fails after the handler answered keeps the claim
//!   until its lease runs out (the caller gets `UNAVAILABLE`): a gRPC
//!   status comes after the message, so the handler's outcome is unknown,
//!   and released, a retry would run it again at once beside an effect
//!   that may be done. After the lease a retry takes it over under the
//!   same operation id. (A head that already named a status that is not
//!   stored releases, as that status would.)
//! - The claim and the handler run on a task of their own: a caller that
//!   goes away, or whose deadline passes, cancels neither half-way, so its
//!   retry gets the answer stored.
//! - The handler finds the claim in its request's extensions
//!   ([`Idempotency`]): its operation id, the same across retries and
//!   takeovers, is the key to pass to anything downstream.
//! - The store failing before anything ran: `UNAVAILABLE`.
//! - Every status the layer answers itself (a missing, invalid or reused
//!   key, one in flight, a message it cannot read, the store away, a
//!   handler that failed before answering, [`MetadataScope`]'s missing
//!   scope) carries a `google.rpc.ErrorInfo`
//!   in its details, domain `idem`, reason `IDEMPOTENCY_…`
//!   ([`LayerRefusal::of`] reads it): a client tells them from the
//!   handler's own statuses with the same codes, which carry none.
//! - The handler runs on a task of its own: a caller that goes away does
//!   not cancel it half-way, and its answer is still stored for the retry.
//!   Such handlers are counted process-wide: after your server's graceful
//!   shutdown returns, await [`idem_once::detached::idle`] within your
//!   grace, so that the process does not exit under them.
//!
//! Leases, takeover and fencing are those of every idem store: a holder
//! that crashed frees the key when its lease runs out, and an attempt
//! whose claim was taken over cannot store its answer. The handler's own
//! writes are not fenced, and the answer is stored after the handler (not
//! in its transaction): make the effect idempotent on the operation id (a
//! unique constraint on it). A handler whose outcome may be unknown (a
//! downstream call that can time out) calls [`Idempotency::keep_claim`]
//! before it: whatever it then answers (or if it panics), the key stays
//! held until its lease runs out, and the retry after it takes the key over
//! under the same operation id; [`Idempotency::settle_by_answer`] undoes
//! it once the outcome is known. [`Idempotency::release_claim`] frees the
//! key whatever the status (an answer that is not the call's outcome), and
//! [`Idempotency::abandon`] neither stores nor releases (a step's lease
//! ran out). [`Idempotency::lease_left`] bounds a downstream call.
//!
//! # The client
//!
//! [`IdempotentRetryLayer`] goes on a tonic `Channel`: each call to a
//! chosen method gets one key (yours, as an [`IntentKey`] in the request's
//! extensions, or a random UUID) and is retried under it.

mod answer;
mod client;
mod frame;
mod handle;
mod layer;
mod refusal;
mod service;

pub use answer::{IDEMPOTENT_REPLAYED, RETRY_AFTER, RETRY_PUSHBACK};
pub use client::{
    is_retryable_code, BoxError, IdempotentRetry, IdempotentRetryBuilder, IdempotentRetryLayer,
    IntentKey, RetryError, RetryOutcome,
};
pub use handle::{Idempotency, IDEMPOTENCY_KEY};
pub use layer::{IdempotencyLayer, MetadataScope, ScopeExtractor, SingleScope};
pub use refusal::{LayerRefusal, ERROR_DOMAIN};
pub use service::{IdempotencyService, ResponseFuture};
