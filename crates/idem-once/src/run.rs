//! [`Runner`]: run an async closure at most once per `(scope, key)`.

use std::time::{Duration, Instant};

use idem_core::{
    BeginTransaction, Claim, ClaimOutcome, ClaimRequest, Fingerprint, Policy, Record, RecordState,
    Store, StoreError, StoredResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::{debug, info, warn};

use crate::claim::{claim_until_decided, Found, Refusal};
use crate::operation::Operation;

/// The status a stored output is kept under.
pub(crate) const OUTPUT: u16 = 200;
/// The status a stored final error is kept under.
pub(crate) const FINAL_ERROR: u16 = 400;

/// What a run gave: its output, telling whether this call ran the work or
/// got the first run's output back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// This call ran the work; its output is stored.
    Fresh(T),
    /// An earlier call ran it; this is its stored output. The work did not
    /// run.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// The output, fresh or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Outcome::Fresh(v) | Outcome::Replayed(v) => v,
        }
    }

    /// The output, fresh or replayed.
    pub fn get(&self) -> &T {
        match self {
            Outcome::Fresh(v) | Outcome::Replayed(v) => v,
        }
    }

    /// Whether an earlier call ran the work.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Outcome::Replayed(_))
    }
}

/// How the work failed: whether a repeat may run it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure<E> {
    /// Released: the next call with the key runs the work again (under the
    /// same operation id, its completed steps replayed). What `?` makes of
    /// an `E`.
    Retry(E),
    /// Final: stored like an output, and every repeat gets it back
    /// ([`RunError::Final`]) without running the work.
    Final(E),
}

impl<E> From<E> for Failure<E> {
    fn from(e: E) -> Self {
        Failure::Retry(e)
    }
}

/// Why a run did not give an output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// The key is not 1 to 255 visible ASCII characters, or the scope is
    /// empty or longer than [`MAX_SCOPE_LEN`](idem_core::MAX_SCOPE_LEN)
    /// bytes. Nothing was stored.
    #[error("invalid run key: {0}")]
    InvalidKey(&'static str),
    /// The input does not serialize (to be fingerprinted). Nothing ran.
    #[error("the input does not serialize: {0}")]
    Input(#[source] serde_json::Error),
    /// The key was first used with other input. Nothing ran.
    #[error("the key was already used with other input")]
    KeyReused,
    /// Another caller is running the key (under a live lease), and the
    /// policy's wait, if any, ran out. Nothing ran; retry after
    /// `retry_after`.
    #[error("another caller is running this key; retry after {retry_after:?}")]
    InFlight {
        /// When a retry may find it settled.
        retry_after: Duration,
    },
    /// The store could not be reached or failed before the work ran.
    /// Nothing ran.
    #[error("the store is unavailable; nothing ran")]
    Unavailable(#[source] StoreError),
    /// The work ran, but its lease ran out and another caller took the key
    /// over: this run's output was refused (fenced), and the holder's
    /// stands. In a transactional run, its writes were rolled back.
    #[error(
        "the lease ran out and another caller took the key over; this run's output was not stored"
    )]
    LeaseLost,
    /// The work ran, but its output could not be stored. In
    /// [`run`](Runner::run): if the store failed (it was tried again while
    /// the lease lasted), the key stays claimed until the lease runs out;
    /// if the output does not serialize, the claim is released. In
    /// [`run_in_transaction`](Runner::run_in_transaction): the transaction
    /// was rolled back and the claim released when the completion failed;
    /// when the commit itself failed, the claim stays until its lease runs
    /// out (the commit may have landed: a retry then gets the stored
    /// output, as a replay). Otherwise a retry runs the work again under the
    /// same operation id, its completed steps replayed.
    #[error("the work ran but its output was not stored: {0}")]
    NotStored(String),
    /// The work failed; the claim was released, so the next call runs it
    /// again (its completed steps replayed).
    #[error("the work failed and was released for a retry: {0}")]
    Failed(E),
    /// The work failed with an error marked [`Failure::Final`]: stored,
    /// and every repeat gets it back.
    #[error("the work failed for good{}: {error}", if *.replayed { " (replayed)" } else { "" })]
    Final {
        /// The error.
        error: E,
        /// Whether an earlier call failed with it (this one ran nothing).
        replayed: bool,
    },
    /// The stored record does not decode into the output or error type
    /// asked for (another type was stored under the key, or the record is
    /// not a run's).
    #[error("the stored result does not decode: {0}")]
    Decode(String),
}

/// Runs async work at most once per `(scope, key)`, on any [`Store`].
///
/// Cheap to clone when the store is (the SQL stores are handles; wrap
/// others in an `Arc`).
#[derive(Debug, Clone)]
pub struct Runner<S> {
    store: S,
    policy: Policy,
}

impl<S: Store> Runner<S> {
    /// A runner over `store`. Of `policy`, runs use the retention, the
    /// lease, the wait for an in-flight holder and the retry hint.
    pub fn new(store: S, policy: Policy) -> Self {
        Self { store, policy }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Runs `work` at most once for `(scope, key)` and `input`.
    ///
    /// - The first call claims the key (fingerprinting `input` as canonical
    ///   JSON) and runs `work`, given the [`Operation`] (its id, stable
    ///   across takeovers, to pass downstream; its fencing token; its
    ///   steps). Its output is stored, fenced: [`Outcome::Fresh`].
    /// - A repeat gets the stored output, without running `work`:
    ///   [`Outcome::Replayed`].
    /// - Another input under the key: [`RunError::KeyReused`]. While another
    ///   caller runs it: [`RunError::InFlight`] (or a wait, per the
    ///   policy). A caller that crashed is taken over after its lease,
    ///   under the same operation id.
    /// - `work` fails with [`Failure::Retry`] (what `?` gives): released,
    ///   [`RunError::Failed`]; with [`Failure::Final`]: stored,
    ///   [`RunError::Final`], and every repeat gets it back.
    ///
    /// A run that is cancelled (its future dropped) or panics keeps its
    /// claim until the lease runs out, as a crashed one does; then a retry
    /// takes it over.
    pub async fn run<I, T, E, F>(
        &self,
        scope: &str,
        key: &str,
        input: &I,
        work: F,
    ) -> Result<Outcome<T>, RunError<E>>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&Operation<'_, S>) -> Result<T, Failure<E>>,
    {
        let (claim, claimed_at) = match self.claim(scope, key, input).await? {
            Claimed::Replay(outcome) => return outcome,
            Claimed::Ours(claim, at) => (claim, at),
        };
        let op = Operation::new(&self.store, claim, &self.policy, claimed_at);
        let result = work(&op).await;
        let (claim, deadline) = op.into_parts();
        match result {
            Ok(output) => {
                let stored = self.encode_output(&claim, &output).await?;
                match complete_retrying(&self.store, &claim, &stored, deadline).await {
                    Ok(()) => Ok(Outcome::Fresh(output)),
                    Err(e) => Err(not_stored(e)),
                }
            }
            Err(Failure::Retry(error)) => {
                self.release(&claim).await;
                Err(RunError::Failed(error))
            }
            Err(Failure::Final(error)) => self.store_final(&claim, error, deadline).await,
        }
    }

    /// Like [`run`](Self::run), with `work` in a transaction on the store's
    /// database: its writes and the stored output commit together, fenced
    /// by this run's token (SQLite, PostgreSQL, MySQL).
    ///
    /// The claim commits first (binding the key to this input and its
    /// operation id), then the transaction begins; `work` gets it. On
    /// [`Failure::Retry`] it rolls back and the claim is released; on
    /// [`Failure::Final`] it rolls back and the error is stored. Every way
    /// out this function returns by ends the transaction explicitly; a
    /// panic in `work`, or the future dropped mid-way, leaves the rollback
    /// to the driver (sqlx rolls back a transaction dropped unfinished
    /// when its connection goes back to the pool).
    ///
    /// Steps ([`Operation::step`]) are refused inside a transactional run
    /// ([`StepError::InsideTransaction`](crate::StepError::InsideTransaction)):
    /// a step's output commits on its own, which one transaction cannot do.
    pub async fn run_in_transaction<I, T, E, F>(
        &self,
        scope: &str,
        key: &str,
        input: &I,
        work: F,
    ) -> Result<Outcome<T>, RunError<E>>
    where
        S: BeginTransaction,
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&Operation<'_, S>, &mut S::Connection) -> Result<T, Failure<E>>,
    {
        let (claim, claimed_at) = match self.claim(scope, key, input).await? {
            Claimed::Replay(outcome) => return outcome,
            Claimed::Ours(claim, at) => (claim, at),
        };
        let mut tx = match self.store.begin_transaction().await {
            Ok(tx) => tx,
            Err(e) => {
                self.release(&claim).await;
                return Err(RunError::Unavailable(e));
            }
        };
        let op = Operation::new(&self.store, claim, &self.policy, claimed_at).in_transaction();
        let result = work(&op, S::connection(&mut tx)).await;
        let (claim, deadline) = op.into_parts();
        let output = match result {
            Ok(output) => output,
            Err(failure) => {
                rollback::<S>(tx).await;
                return match failure {
                    Failure::Retry(error) => {
                        self.release(&claim).await;
                        Err(RunError::Failed(error))
                    }
                    Failure::Final(error) => self.store_final(&claim, error, deadline).await,
                };
            }
        };
        let stored = match encode(OUTPUT, &output) {
            Ok(stored) => stored,
            Err(e) => {
                rollback::<S>(tx).await;
                return Err(self.unencodable(&claim, &e).await);
            }
        };
        if let Err(e) = self
            .store
            .complete_in_tx(S::connection(&mut tx), &claim, &stored)
            .await
        {
            rollback::<S>(tx).await;
            if !matches!(e, StoreError::ClaimLost) {
                self.release(&claim).await;
            }
            return Err(not_stored(e));
        }
        match S::commit(tx).await {
            Ok(()) => {
                self.store.settled(&claim).await;
                Ok(Outcome::Fresh(output))
            }
            Err(e) => {
                // Nothing committed (or the outcome is unknown): the lease
                // decides; a retry resumes under the same operation id.
                warn!(error = %e, "the run's transaction did not commit");
                Err(not_stored(e))
            }
        }
    }

    /// Claims the key for `input`, or what to give instead.
    async fn claim<I, T, E>(
        &self,
        scope: &str,
        key: &str,
        input: &I,
    ) -> Result<Claimed<T, E>, RunError<E>>
    where
        I: Serialize + ?Sized,
        T: DeserializeOwned,
        E: DeserializeOwned,
    {
        check_key(scope, key)?;
        let fingerprint = fingerprint(input).map_err(RunError::Input)?;
        let request = ClaimRequest {
            scope: scope.to_owned(),
            key: key.to_owned(),
            fingerprint,
            lease: self.policy.lease(),
            retention: self.policy.retention(),
        };
        let found = claim_until_decided(&self.policy, &request.fingerprint, || async {
            // The lease counts from when the winning claim was sent.
            let sent = Instant::now();
            Ok(match self.store.claim(&request).await? {
                ClaimOutcome::Acquired(claim) => Found::Acquired((claim, sent)),
                ClaimOutcome::Existing(record) => Found::Existing(record),
            })
        })
        .await;
        match found {
            Ok((claim, sent)) => {
                if claim.takeover {
                    info!(operation_id = %claim.operation_id, "run: took over an expired or released claim");
                } else {
                    debug!(operation_id = %claim.operation_id, "run: claimed");
                }
                Ok(Claimed::Ours(claim, sent))
            }
            Err(Refusal::Replay(record)) => Ok(Claimed::Replay(replay(&record))),
            Err(Refusal::Mismatch) => Err(RunError::KeyReused),
            Err(Refusal::InFlight { retry_after }) => Err(RunError::InFlight { retry_after }),
            Err(Refusal::Unavailable(e)) => Err(RunError::Unavailable(e)),
        }
    }

    /// `output` as the record stores it; if it does not serialize, the
    /// claim is released and the error says why.
    async fn encode_output<T: Serialize, E>(
        &self,
        claim: &Claim,
        output: &T,
    ) -> Result<StoredResponse, RunError<E>> {
        match encode(OUTPUT, output) {
            Ok(stored) => Ok(stored),
            Err(e) => Err(self.unencodable(claim, &e).await),
        }
    }

    /// Releases `claim`, whose output does not serialize.
    async fn unencodable<E>(&self, claim: &Claim, e: &serde_json::Error) -> RunError<E> {
        self.release(claim).await;
        RunError::NotStored(format!("the output does not serialize: {e}"))
    }

    /// Stores `error` as the run's final answer.
    async fn store_final<T, E: Serialize>(
        &self,
        claim: &Claim,
        error: E,
        deadline: Instant,
    ) -> Result<Outcome<T>, RunError<E>> {
        let stored = match encode(FINAL_ERROR, &error) {
            Ok(stored) => stored,
            Err(e) => {
                warn!(error = %e, "a final error does not serialize; released instead");
                self.release(claim).await;
                return Err(RunError::Failed(error));
            }
        };
        match complete_retrying(&self.store, claim, &stored, deadline).await {
            Ok(()) => Err(RunError::Final {
                error,
                replayed: false,
            }),
            Err(e) => Err(not_stored(e)),
        }
    }

    /// Releases `claim`; a release that fails leaves it to the lease.
    async fn release(&self, claim: &Claim) {
        if let Err(e) = self.store.release(claim).await {
            warn!(error = %e, operation_id = %claim.operation_id, "release failed; the claim frees when its lease runs out");
        }
    }
}

/// A claim that is ours, or the stored result to give back.
enum Claimed<T, E> {
    /// The claim, and when it was sent.
    Ours(Claim, Instant),
    Replay(Result<Outcome<T>, RunError<E>>),
}

/// Completes `claim` with `stored`, trying again (with a growing pause)
/// while the store fails and the lease lasts: the work ran, and a
/// completion is fenced, so trying again is safe and spares a re-run (one
/// that landed though its answer was lost stands: see `Store::complete`).
pub(crate) async fn complete_retrying<S: Store + ?Sized>(
    store: &S,
    claim: &Claim,
    stored: &StoredResponse,
    deadline: Instant,
) -> Result<(), StoreError> {
    let mut pause = Duration::from_millis(50);
    loop {
        match store.complete(claim, stored).await {
            Err(StoreError::Unavailable(e)) if Instant::now() + pause < deadline => {
                warn!(error = %e, "completing failed; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

/// What a completion failure means for the caller.
fn not_stored<E>(e: StoreError) -> RunError<E> {
    match e {
        StoreError::ClaimLost => RunError::LeaseLost,
        other => RunError::NotStored(other.to_string()),
    }
}

/// Rolls `tx` back now, before answering.
async fn rollback<S: BeginTransaction>(tx: S::Transaction) {
    if let Err(e) = S::rollback(tx).await {
        warn!(error = %e, "rollback failed (the connection is gone, and the transaction with it)");
    }
}

/// A completed record's output (or final error), decoded.
fn replay<T: DeserializeOwned, E: DeserializeOwned>(
    record: &Record,
) -> Result<Outcome<T>, RunError<E>> {
    let RecordState::Completed { response, .. } = &record.state else {
        return Err(RunError::Decode("the record is not completed".into()));
    };
    match response.status {
        OUTPUT => serde_json::from_slice(&response.body)
            .map(Outcome::Replayed)
            .map_err(|e| RunError::Decode(format!("the stored output: {e}"))),
        FINAL_ERROR => match serde_json::from_slice(&response.body) {
            Ok(error) => Err(RunError::Final {
                error,
                replayed: true,
            }),
            Err(e) => Err(RunError::Decode(format!("the stored final error: {e}"))),
        },
        other => Err(RunError::Decode(format!(
            "the record holds status {other}, not a run's result (is the key used by another edge?)"
        ))),
    }
}

/// `value` as a stored record's body.
pub(crate) fn encode<T: Serialize + ?Sized>(
    status: u16,
    value: &T,
) -> Result<StoredResponse, serde_json::Error> {
    Ok(StoredResponse {
        status,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: bytes::Bytes::from(serde_json::to_vec(value)?),
    })
}

/// The fingerprint of a run's input: its canonical JSON, as a JSON
/// request body is fingerprinted (`1000` and `1000.0` are the same input;
/// key order does not count). An input whose JSON holds a key twice (a
/// `#[serde(flatten)]` map with a key its struct also has), or nests
/// arrays and objects 128 deep, is compared by its bytes, so its
/// maps must serialise in a stable order (a `BTreeMap`, not a
/// `HashMap`).
pub fn fingerprint<I: Serialize + ?Sized>(input: &I) -> Result<Fingerprint, serde_json::Error> {
    let json = serde_json::to_vec(input)?;
    Ok(Fingerprint::of_request(
        "RUN",
        "",
        Some("application/json"),
        &json,
    ))
}

/// Checks a run's scope and key as [`Runner::run`] does, without a store:
/// why they would be refused ([`RunError::InvalidKey`]), if they would.
///
/// Run keys follow the `Idempotency-Key` header's rules: 1 to 255 visible
/// ASCII characters (so no key a run makes for its steps, which hold
/// spaces, can collide with one); the scope is 1 to
/// [`MAX_SCOPE_LEN`](idem_core::MAX_SCOPE_LEN) bytes.
///
/// ```
/// assert!(idem_once::check_run_key("jobs", "nightly-2026-12-01").is_ok());
/// assert!(idem_once::check_run_key("jobs", "two words").is_err());
/// assert!(idem_once::check_run_key("", "k").is_err());
/// assert!(idem_once::check_run_key(&"j".repeat(1024), "k").is_ok());
/// assert!(idem_once::check_run_key(&"j".repeat(1025), "k").is_err());
/// ```
pub fn check_run_key(scope: &str, key: &str) -> Result<(), &'static str> {
    if scope.is_empty() {
        return Err("the scope is empty");
    }
    if scope.len() > idem_core::MAX_SCOPE_LEN {
        return Err("the scope is longer than 1024 bytes");
    }
    if key.is_empty()
        || key.len() > idem_core::MAX_KEY_LEN
        || !key.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err("a key is 1 to 255 visible ASCII characters");
    }
    Ok(())
}

fn check_key<E>(scope: &str, key: &str) -> Result<(), RunError<E>> {
    check_run_key(scope, key).map_err(RunError::InvalidKey)
}
