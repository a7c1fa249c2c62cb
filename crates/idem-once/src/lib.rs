//! Run once: idem's rule for any async work, with no transport.
//!
//! A job retried by its scheduler, a cron task started on three hosts, a
//! handler that calls two external systems: [`Runner::run`] claims
//! `(scope, key)` first, runs the work at most once, stores its output
//! (fenced by the claim's token) and gives it to every repeat.
//!
//! ```
//! use idem_memory::MemoryStore;
//! use idem_once::{Failure, Outcome, Runner};
//! use std::sync::{atomic::{AtomicU32, Ordering}, Arc};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let runner = Runner::new(Arc::new(MemoryStore::new()), idem_core::Policy::default());
//! let sent = AtomicU32::new(0);
//! let send_invoice = async |op: &idem_once::Operation<'_, _>| -> Result<String, Failure<String>> {
//!     // The operation id is the same on every attempt: the mailer
//!     // deduplicates on it.
//!     sent.fetch_add(1, Ordering::SeqCst);
//!     Ok(format!("invoice mailed under {}", op.id()))
//! };
//! let input = ("invoice", 42, "EUR");
//! let first = runner.run("billing", "invoice-42", &input, send_invoice).await;
//! let again = runner.run("billing", "invoice-42", &input, send_invoice).await;
//! assert!(matches!(first, Ok(Outcome::Fresh(_))));
//! assert!(matches!(&again, Ok(Outcome::Replayed(_))));
//! assert_eq!(first.unwrap().into_inner(), again.unwrap().into_inner());
//! assert_eq!(sent.load(Ordering::SeqCst), 1);
//! // The same key with other input is refused, and runs nothing.
//! let other = runner.run("billing", "invoice-42", &("invoice", 43, "EUR"), send_invoice).await;
//! assert!(matches!(other, Err(idem_once::RunError::KeyReused)));
//! # }
//! ```
//!
//! - **Fenced**: the work gets an [`Operation`]: its id (stable across
//!   takeovers, to pass downstream) and its fencing token. A caller whose
//!   lease ran out and was taken over cannot store its output
//!   ([`RunError::LeaseLost`]).
//! - **Errors**: a failure ([`Failure::Retry`], what `?` gives) releases
//!   the key: the next call runs again. [`Failure::Final`] is stored and
//!   every repeat gets it back.
//! - **Transactional** ([`Runner::run_in_transaction`]): on SQLite,
//!   PostgreSQL and MySQL, the work's writes and the stored output commit
//!   in one transaction.
//! - **Steps** ([`Operation::step`]): each named step runs until it
//!   completes once per operation, each once the one before it completed; a run resumed after a crash gets the
//!   stored output back instead of calling again. Each step has a
//!   [key](Step::key) of its own for the system it calls.
//!   [`Operation::step_in_transaction`] commits the step's output with
//!   its writes. A run retried for longer than its retention (the shortest
//!   any of its attempts was claimed with) refuses a step whose record may
//!   have expired ([`StepError::Forgotten`]) rather than call it again.
//!
//! Any [`Store`](idem_core::Store) serves: the step records live beside
//! the run's, in the same table (or Redis), and are swept with them.

mod bounded;
mod claim;
pub mod detached;
mod operation;
mod run;

pub use bounded::{BoundedStore, StoreTimedOut};
pub use claim::{claim_until_decided, Found, Refusal};
pub use operation::{
    step_key, step_record_key, Operation, Step, StepError, StepStart, MAX_STEP_NAME,
    STEP_NAME_HEADER,
};
pub use run::{check_run_key, fingerprint, Failure, Outcome, RunError, Runner};
