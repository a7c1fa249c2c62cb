//! The HTTP edge of idem: a tower [`IdempotencyLayer`] for axum 0.8 and the
//! [`Idempotency`] extractor, making `POST` and `PATCH` safe to retry.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{body::Body, routing::post, Router};
//! use http::{Request, StatusCode};
//! use idem_axum::{Idempotency, IdempotencyLayer, SingleScope};
//! use idem_core::Policy;
//! use idem_memory::MemoryStore;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! async fn pay(idem: Idempotency) -> (StatusCode, String) {
//!     // Give `idem.operation_id()` to the payment provider as its idempotency key.
//!     (StatusCode::CREATED, format!("charged under {}", idem.operation_id()))
//! }
//!
//! let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()), Policy::default(), SingleScope("shop".into()));
//! let app = Router::new().route("/payments", post(pay)).layer(layer);
//!
//! let request = || Request::post("/payments")
//!     .header("idempotency-key", "7b1c7a4e-order-42")
//!     .header("content-type", "application/json")
//!     .body(Body::from(r#"{"amount":1000}"#))
//!     .unwrap();
//! let first = app.clone().oneshot(request()).await.unwrap();
//! let again = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(again.status(), StatusCode::CREATED);
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! # The contract
//!
//! | situation | answer |
//! |---|---|
//! | new key | run the handler, store status + allow-listed headers + body, return it |
//! | same key and request, completed | the stored response byte for byte, `Idempotent-Replayed: true`; the handler does not run |
//! | same key, in flight (lease alive) | `409` with `Retry-After`, or wait (bounded) and replay if the policy says so |
//! | same key, in flight, lease expired | take the claim over (new token, same operation id) and run |
//! | same key, different request | `422` |
//! | key missing (where required) or malformed | `400` |
//! | body over the limit | `413`, nothing stored |
//! | handler answered `4xx` | stored and replayed; but a "try again later" (`408`, `425`, `429`: a timeout or rate limiter inside the layer, say) releases the claim, so the retry runs (same operation id). [`PolicyBuilder::store_client_error`](idem_core::PolicyBuilder::store_client_error) and [`release_client_error`](idem_core::PolicyBuilder::release_client_error) change the list |
//! | handler answered `5xx` or panicked before answering (`500`) | claim released: the next retry runs (same operation id) |
//! | the handler's answer could not be read or stored (its body failed or panicked, the store failed) | the claim is held until its lease ends, then the retry runs (same operation id) |
//! | client disconnected mid-request | the handler runs to the end on its own task; its answer is stored for the retry |
//! | the handler's outcome is unknown ([`Idempotency::keep_claim`]: a call it made timed out) | its answer passed on, neither stored nor released: the key is held until its lease ends |
//! | the answer is not the outcome ([`Idempotency::release_claim`]: a rate limit) | passed on, the claim released |
//! | the answer is the outcome whatever its status ([`Idempotency::store_answer`]: a `502` saying an effect happened whose answer is lost) | stored and replayed |
//!
//! With the `serve` feature, `serve::serve` serves an app with header and
//! body timeouts, a connection cap and a graceful drain.
//!
//! Errors are `application/problem+json` whose `type` ends in
//! `idempotency-key-missing`, `idempotency-key-invalid`,
//! `idempotency-key-in-use`, `idempotency-key-reused`, `payload-too-large`
//! (and `store-unavailable`, `503`, when the store cannot be reached).
//!
//! # Committing the record with the business write
//!
//! On a SQL store, a handler completes the record inside its own transaction
//! with [`Idempotency::complete_in`]. Completion is
//! fenced by the claim's token: if a retry took the claim over because this
//! attempt outlived its lease, completion touches no row, the handler rolls
//! back, and its effect does not commit.
//!
//! # Holding the claim in the business transaction
//!
//! With [`IdempotencyLayer::claim_in_transaction`], the handler claims the
//! key itself with [`DeferredClaim::begin`] and gets the transaction that
//! holds the claim. The claim commits first, binding the key to the request
//! and its operation id before any effect; while the transaction is open,
//! duplicates get `409`; when it ends (a commit, a rollback, a crash) the
//! claim is free at once, with no lease to wait out. See
//! [`ClaimInTransaction`](idem_core::ClaimInTransaction) for the trade-off.

// Configuration, and the tower `Service` it makes.
mod config;
mod layer;
mod service;
// One request's way through the layer, phase by phase: reading, claiming
// (in the layer, or deferred to the handler's transaction), finishing.
mod claim;
mod deferred;
mod finish;
mod handle;
mod request;
// What handlers extract, and what the layer answers instead of them.
mod extract;
mod guarded;
mod metrics;
pub mod problem;
mod rejection;
mod scope;

pub mod conditional;
#[cfg(feature = "serve")]
pub mod serve;

#[doc(hidden)]
pub use claim::replayed_headers;
pub use claim::IDEMPOTENT_REPLAYED;
pub use deferred::{ClaimRefused, DeferredClaim};
pub use extract::{CompleteError, Idempotency};
pub use guarded::{Guarded, HandlerError};
pub use layer::IdempotencyLayer;
pub use problem::Problem;
pub use rejection::IdempotencyRejection;
pub use rejection::IDEMPOTENCY_REJECTION;
pub use request::IDEMPOTENCY_KEY;
pub use scope::{scope_missing, HeaderScope, ScopeExtractor, SingleScope};
pub use service::{IdempotencyService, ResponseFuture};
