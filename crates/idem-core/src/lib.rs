//! The pure core of idem: everything that decides, nothing that does I/O.
//!
//! - [`IdempotencyKey`]: parsing the `Idempotency-Key` header (bare or
//!   Structured Field string form);
//! - [`Fingerprint`]: SHA-256 over method, path and body, with JSON bodies
//!   canonicalised (after RFC 8785);
//! - [`Record`], [`Claim`], [`FencingToken`], [`OperationId`]: the record and
//!   its states;
//! - [`on_missing_key`], [`on_arrival`], [`on_handler_end`]: the decision
//!   table of the HTTP contract, one pure function per phase;
//! - [`Policy`]: retention, lease, waiting, body limit, replayed headers;
//! - [`Store`]: the trait every store implements.
//!
//! ```
//! use idem_core::{on_arrival, Arrival, Fingerprint, IdempotencyKey, Policy, UnixMillis};
//!
//! let key = IdempotencyKey::parse(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)?;
//! let fingerprint = Fingerprint::of_request("POST", "/payments", Some("application/json"),
//!     br#"{"amount": 1000, "currency": "EUR"}"#);
//! let policy = Policy::default();
//! // Nothing stored under the key yet: run the handler.
//! assert_eq!(on_arrival(&policy, None, &fingerprint, UnixMillis::now()), Arrival::Run);
//! assert_eq!(key.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
//! # Ok::<(), idem_core::KeyError>(())
//! ```

pub mod backoff;
mod canonical;
pub mod decision;
pub mod fingerprint;
pub mod key;
pub mod ops;
pub mod policy;
pub mod record;
pub mod store;

pub use backoff::Backoff;
pub use decision::{
    on_arrival, on_handler_end, on_missing_key, Arrival, HandlerEnd, MissingKey, Settlement,
};
pub use fingerprint::Fingerprint;
pub use key::{
    single_visible_value, IdempotencyKey, KeyError, IDEMPOTENCY_KEY_HEADER, MAX_KEY_LEN,
    MAX_SCOPE_LEN,
};
pub use ops::{Inspection, StoreStats};
pub use policy::{
    capped_millis, Policy, PolicyBuilder, PolicyError, DEFAULT_RELEASED_CLIENT_ERRORS,
    DEFAULT_STORE_TIMEOUT, LONGEST,
};
pub use record::{
    Claim, CorruptRecord, FencingToken, OperationId, Record, RecordParts, RecordRow, RecordState,
    StoredResponse, UnixMillis,
};
pub use store::{
    sweep_all, BeginTransaction, BoxFuture, ClaimInTransaction, ClaimOutcome, ClaimRequest, Store,
    StoreError, TransactionalStore, TxClaimOutcome,
};
