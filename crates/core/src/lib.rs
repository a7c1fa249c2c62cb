//! The pure core of idem: everything that decides, nothing that does I/O.
//!
//! - [`IdempotencyKey`]: parsing the `Idempotency-Key` header (bare or
//!   Structured Field string form);
//! - [`Fingerprint`]: SHA-256 over method, path and body, with JSON bodies
//!   canonicalised (RFC 8785);
//! - [`Record`], [`Claim`], [`FencingToken`], [`OperationId`]: the record and
//!   its states;
//! - [`decide`]: the decision table of the HTTP contract as one pure function;
//! - [`Policy`]: retention, lease, waiting, body limit, replayed headers;
//! - [`Store`]: the trait every store implements.
//!
//! ```
//! use idem_core::{decide, Decision, Fingerprint, IdempotencyKey, Policy, Situation, UnixMillis};
//!
//! let key = IdempotencyKey::parse(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)?;
//! let fingerprint = Fingerprint::of_request("POST", "/payments", Some("application/json"),
//!     br#"{"amount": 1000, "currency": "EUR"}"#);
//! let policy = Policy::default();
//! // Nothing stored under the key yet: run the handler.
//! let decision = decide(&policy, Situation::Arrived { stored: None, fingerprint: &fingerprint, now: UnixMillis::now() });
//! assert_eq!(decision, Decision::Run);
//! assert_eq!(key.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
//! # Ok::<(), idem_core::KeyError>(())
//! ```

pub mod decision;
pub mod fingerprint;
pub mod key;
pub mod ops;
pub mod policy;
pub mod record;
pub mod store;

pub use decision::{decide, Decision, Situation};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use ops::{Inspection, StoreStats};
pub use policy::{Policy, PolicyBuilder, PolicyError};
pub use record::{
    Claim, CorruptRecord, FencingToken, OperationId, Record, RecordRow, RecordState,
    StoredResponse, UnixMillis,
};
pub use store::{
    sweep_all, BoxFuture, ClaimInTransaction, ClaimOutcome, ClaimRequest, Store, StoreError,
    TransactionalStore, TxClaimOutcome,
};
