//! [`Operation`]: what a run's work is given, and its named [`Step`]s.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::{
    BeginTransaction, Claim, ClaimOutcome, ClaimRequest, FencingToken, Fingerprint, OperationId,
    Policy, Record, RecordState, Store, StoreError, StoredResponse, UnixMillis,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tracing::{debug, warn};
use uuid::Uuid;

use crate::run::{encode, OUTPUT};

/// The stored header that names a completed step (`idem inspect` shows it).
pub const STEP_NAME_HEADER: &str = "idem-step";

/// How long a step held by an earlier attempt is waited for before
/// [`StepError::InFlight`].
const MAX_STEP_WAIT: Duration = Duration::from_secs(2);

/// The longest step name, in bytes.
pub const MAX_STEP_NAME: usize = 64;

/// The status a step's record is completed with when the step was found
/// forgotten ([`StepError::Forgotten`]): every later run is refused too.
const FORGOTTEN: u16 = 410;

/// What a forgotten step's record holds: not JSON, so that no version of
/// idem reads it as a step's output.
const FORGOTTEN_BODY: &[u8] =
    b"forgotten: the run outlived its retention; this step may have run on an earlier attempt";

/// The most the clocks of two records' stores may differ (the nodes of a
/// Redis Cluster hold an operation's records in different slots): taken
/// off the retention before trusting that a record has not expired.
const CLOCK_MARGIN: Duration = Duration::from_secs(5);

/// A claimed run: its operation id, its fencing token, and its steps.
///
/// Made by [`Runner`](crate::Runner) for the work it runs, or by an edge
/// that claimed a key itself ([`Operation::new`]; e.g. an axum handler
/// behind the idempotency layer, from its claim).
#[derive(Debug)]
pub struct Operation<'s, S: ?Sized> {
    store: &'s S,
    claim: Claim,
    retention: Duration,
    /// When the claim's lease ends, on this process's monotonic clock
    /// (never compared with the store's clock).
    deadline: Instant,
    in_transaction: bool,
    names: Mutex<Vec<String>>,
    /// What this run knows of the last step decided: where the next one
    /// may have been before.
    before: Mutex<Before>,
}

/// The step before the next one, as this run knows it. Steps start one
/// after another, each once the one before it completed: so no record of a
/// step was ever made before the step before it completed.
#[derive(Debug, Clone, Copy)]
enum Before {
    /// None decided yet: the next is the first, whose record can be no
    /// older than the run's.
    Nothing,
    /// Completed by an earlier attempt, at this time (the store's clock).
    CompletedAt(UnixMillis),
    /// Claimed by this run, so not completed before it: no attempt before
    /// this one got past it. Whether it completed since is asked of the
    /// store when the next step starts, unless this run saw it.
    Claimed,
    /// Claimed and completed by this run.
    CompletedHere,
    /// Its position was kept though it was refused as out of order: it
    /// never ran in this run, so no later step may start.
    Skipped,
}

/// Why a step gave no output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The step's work failed; nothing was stored, and a resumed run calls
    /// it again (under the same step key).
    #[error("step failed: {0}")]
    Failed(E),
    /// A step name is 1 to 64 of `A-Z a-z 0-9 _ . : -`.
    #[error("invalid step name {0:?}: a step name is 1 to 64 of A-Z a-z 0-9 _ . : -")]
    InvalidName(String),
    /// This run already asked for a step of this name.
    #[error("step {0:?} was already asked for in this run: step names are unique per operation")]
    DuplicateName(String),
    /// The operation's step at this position was stored under another
    /// name: the resumed run asks for its steps in another order than the
    /// first one did.
    #[error("step #{index} is {name:?} in this run, but the operation stored another step at #{index}: steps must be asked for in the same order on every run")]
    OutOfOrder {
        /// The step's position (from 0).
        index: usize,
        /// The name this run asked for there.
        name: String,
    },
    /// An earlier attempt's claim on this step is still alive (it failed
    /// without releasing it, or still runs): retry after `retry_after`.
    /// Nothing ran.
    #[error("an earlier attempt still holds this step; retry after {retry_after:?}")]
    InFlight {
        /// When the earlier attempt's claim on the step ends.
        retry_after: Duration,
    },
    /// Steps run between transactions: not inside a transactional run.
    #[error("steps cannot run inside a transactional run: use Runner::run with Operation::step_in_transaction")]
    InsideTransaction,
    /// The step before this one has not completed (it failed, or was
    /// released, or its claim was never completed): steps start one after
    /// another, each once the one before it completed. Nothing ran.
    #[error("step #{index} {name:?} has not completed: a step starts only once the one before it completed")]
    Unfinished {
        /// The unfinished step's position (from 0).
        index: usize,
        /// Its name.
        name: String,
    },
    /// The operation's lease ran out (another caller may have taken it
    /// over), or the step's completion was fenced: stop, and let the
    /// holder finish.
    #[error("the operation's lease ran out; another caller may hold it now")]
    LeaseLost,
    /// The run was taken over after outliving its retention (retried for
    /// longer than records are kept), and this step has no record although
    /// the step before it completed (or, for the first step, the run
    /// began) a retention ago or more (the shortest retention any attempt
    /// of the run was claimed with, when its record says; else this
    /// attempt's): it may have run on an earlier
    /// attempt and its record expired since, so it is not called. Nothing
    /// ran, and every later run of the operation gets this too: return it
    /// as [`Failure::Final`](crate::Failure::Final). Check the system the
    /// step calls (under the step's key, [`step_key`]) and finish the work
    /// by hand, or start it over under a new run key.
    #[error("step #{index} {name:?} may have run on an earlier attempt whose record has expired (the run outlived its retention): not called again")]
    Forgotten {
        /// The step's position (from 0).
        index: usize,
        /// The step's name.
        name: String,
    },
    /// The store failed; the step's output (if it ran) was not stored.
    #[error("the store failed during the step")]
    Store(#[source] StoreError),
    /// The output does not serialize, or the stored one does not decode
    /// into the type asked for.
    #[error("the step's output does not (de)serialize: {0}")]
    Codec(String),
}

impl<E> StepError<E> {
    /// The same error for another work error type, when it is not
    /// [`StepError::Failed`] (`Err(failed)` when it is).
    pub fn cast<F>(self) -> Result<StepError<F>, E> {
        Ok(match self {
            StepError::Failed(e) => return Err(e),
            StepError::InvalidName(n) => StepError::InvalidName(n),
            StepError::DuplicateName(n) => StepError::DuplicateName(n),
            StepError::OutOfOrder { index, name } => StepError::OutOfOrder { index, name },
            StepError::InFlight { retry_after } => StepError::InFlight { retry_after },
            StepError::InsideTransaction => StepError::InsideTransaction,
            StepError::LeaseLost => StepError::LeaseLost,
            StepError::Forgotten { index, name } => StepError::Forgotten { index, name },
            StepError::Unfinished { index, name } => StepError::Unfinished { index, name },
            StepError::Store(e) => StepError::Store(e),
            StepError::Codec(e) => StepError::Codec(e),
        })
    }
}

/// A step that is this run's to run: its key, to pass downstream.
#[derive(Debug)]
pub struct Step {
    name: String,
    index: usize,
    key: Uuid,
    claim: Claim,
}

impl Step {
    /// The step's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The step's position in the operation (from 0).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The step's own idempotency key: derived from the operation id and
    /// the step's name, the same on every run of the operation (a resumed
    /// run, a takeover). Pass it to the system the step calls, as *its*
    /// idempotency key: a step that crashed after the call but before its
    /// output was stored is called again under the same key.
    pub fn key(&self) -> Uuid {
        self.key
    }

    /// The claim on the step's record: complete it in your own transaction
    /// with [`TransactionalStore::complete_in_tx`](idem_core::TransactionalStore::complete_in_tx)
    /// and [`Step::stored`], then, once committed,
    /// [`Operation::step_committed`].
    pub fn claim(&self) -> &Claim {
        &self.claim
    }

    /// `output` as the step's record stores it (with the step's name, for
    /// `idem inspect`).
    pub fn stored<T: Serialize>(&self, output: &T) -> Result<StoredResponse, serde_json::Error> {
        let mut stored = encode(OUTPUT, output)?;
        stored
            .headers
            .push((STEP_NAME_HEADER.into(), self.name.as_bytes().to_vec()));
        Ok(stored)
    }
}

/// What [`Operation::start_step`] found.
#[derive(Debug)]
pub enum StepStart<T> {
    /// The step completed on an earlier run: its stored output.
    Done(T),
    /// The step is this run's to run.
    Run(Step),
}

/// The step key of `name` in `operation`.
pub fn step_key(operation: OperationId, name: &str) -> Uuid {
    let mut h = Sha256::new();
    h.update(b"idem-step-v1");
    h.update(operation.0.as_bytes());
    h.update(name.as_bytes());
    let digest = h.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Uuid::new_v8(bytes)
}

/// The key of the record that holds step `index` of `operation`, in the
/// operation's scope. It holds spaces, which no `Idempotency-Key` and no
/// run key may: no request can collide with it.
pub fn step_record_key(operation: OperationId, index: usize) -> String {
    format!("{operation} step {index}")
}

/// The fingerprint a step's record is claimed with: its name.
fn step_fingerprint(name: &str) -> Fingerprint {
    Fingerprint::of_request("STEP", name, None, b"")
}

impl<'s, S: Store + ?Sized> Operation<'s, S> {
    /// The operation of `claim`, a claim its caller holds on `store`
    /// under `policy`, asked for at `claimed_at` (before the claim was
    /// sent: the lease is counted from then, on this process's clock, so
    /// it ends no later than the store's). Its steps' records live in
    /// `store` too.
    pub fn new(store: &'s S, claim: Claim, policy: &Policy, claimed_at: Instant) -> Self {
        Self {
            store,
            claim,
            retention: policy.retention(),
            deadline: claimed_at + policy.lease(),
            in_transaction: false,
            names: Mutex::new(Vec::new()),
            before: Mutex::new(Before::Nothing),
        }
    }

    /// How much of the claim's lease is left, on this process's clock.
    pub fn lease_left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    pub(crate) fn in_transaction(mut self) -> Self {
        self.in_transaction = true;
        self
    }

    pub(crate) fn into_parts(self) -> (Claim, Instant) {
        (self.claim, self.deadline)
    }

    /// The operation id: created at the first claim, the same on every
    /// takeover. Pass it downstream as an idempotency key.
    pub fn id(&self) -> OperationId {
        self.claim.operation_id
    }

    /// This run's fencing token: a newer holder has another.
    pub fn token(&self) -> FencingToken {
        self.claim.token
    }

    /// Whether this run took over an earlier one (crashed, timed out, or
    /// failed and released).
    pub fn is_takeover(&self) -> bool {
        self.claim.takeover
    }

    /// The claim this run holds.
    pub fn claim(&self) -> &Claim {
        &self.claim
    }

    /// The store the operation's records live in.
    pub fn store(&self) -> &'s S {
        self.store
    }

    /// Runs step `name` once per operation: the first run that gets here
    /// calls `work` and stores its output (fenced); a run resumed after a
    /// crash or a failure gets the stored output back without calling it.
    ///
    /// `work` gets the [`Step`], whose [`key`](Step::key) is the same on
    /// every run: pass it to the system the step calls. Steps must be asked
    /// for in the same order on every run ([`StepError::OutOfOrder`]).
    pub async fn step<T, E, F>(&self, name: &str, work: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&Step) -> Result<T, E>,
    {
        let step = match self.start_step(name).await? {
            StepStart::Done(output) => return Ok(output),
            StepStart::Run(step) => step,
        };
        match work(&step).await {
            Ok(output) => {
                self.step_done(&step, &output).await?;
                Ok(output)
            }
            Err(e) => {
                self.release_step(&step).await;
                Err(StepError::Failed(e))
            }
        }
    }

    /// Runs step `name` once per operation, in a transaction on the
    /// store's database: `work`'s writes and the step's output commit
    /// together, fenced by the step's token. A run resumed after a crash
    /// gets the stored output back; one that crashed before the commit
    /// runs the step again (nothing of it committed).
    pub async fn step_in_transaction<T, E, F>(&self, name: &str, work: F) -> Result<T, StepError<E>>
    where
        S: BeginTransaction,
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&Step, &mut S::Connection) -> Result<T, E>,
    {
        let step = match self.start_step(name).await? {
            StepStart::Done(output) => return Ok(output),
            StepStart::Run(step) => step,
        };
        let mut tx = match self.store.begin_transaction().await {
            Ok(tx) => tx,
            Err(e) => {
                self.release_step(&step).await;
                return Err(StepError::Store(e));
            }
        };
        let output = match work(&step, S::connection(&mut tx)).await {
            Ok(output) => output,
            Err(e) => {
                rollback::<S>(tx).await;
                self.release_step(&step).await;
                return Err(StepError::Failed(e));
            }
        };
        let stored = match step.stored(&output) {
            Ok(stored) => stored,
            Err(e) => {
                rollback::<S>(tx).await;
                self.release_step(&step).await;
                return Err(StepError::Codec(e.to_string()));
            }
        };
        if let Err(e) = self
            .store
            .complete_in_tx(S::connection(&mut tx), &step.claim, &stored)
            .await
        {
            rollback::<S>(tx).await;
            return Err(match e {
                StoreError::ClaimLost => StepError::LeaseLost,
                other => {
                    self.release_step(&step).await;
                    StepError::Store(other)
                }
            });
        }
        match S::commit(tx).await {
            Ok(()) => {
                self.completed_here(&step);
                self.store.settled(&step.claim).await;
                Ok(output)
            }
            Err(e) => Err(StepError::Store(e)),
        }
    }

    /// Claims step `name`: its stored output if an earlier run completed
    /// it, or the [`Step`] to run. Finish a step run this way with
    /// [`step_done`](Self::step_done) (or by completing its claim in your
    /// transaction), or [`release_step`](Self::release_step).
    pub async fn start_step<T, E>(&self, name: &str) -> Result<StepStart<T>, StepError<E>>
    where
        T: DeserializeOwned,
    {
        if self.in_transaction {
            return Err(StepError::InsideTransaction);
        }
        if name.is_empty()
            || name.len() > MAX_STEP_NAME
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
        {
            return Err(StepError::InvalidName(name.to_owned()));
        }
        // The name takes the next position, and keeps it only once the
        // claim decided (a store error leaves it free for a retry).
        let (index, last) = {
            let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            if names.iter().any(|n| n == name) {
                return Err(StepError::DuplicateName(name.to_owned()));
            }
            (names.len(), names.last().cloned())
        };
        let before = self.before_step(index, last).await?;
        let started = self.decide_step(name, index, before).await;
        if matches!(started, Ok(_) | Err(StepError::OutOfOrder { .. })) {
            let taken = {
                let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
                let taken = names.len() != index;
                if !taken {
                    names.push(name.to_owned());
                    *self.before.lock().unwrap_or_else(|e| e.into_inner()) = match &started {
                        Ok((_, decided)) => *decided,
                        Err(_) => Before::Skipped,
                    };
                }
                taken
            };
            if taken {
                // Another step took the position meanwhile: steps run one
                // after another, never at once. A claim this call made is
                // let go now, not left to the operation's lease.
                if let Ok((StepStart::Run(step), _)) = &started {
                    self.release_step(step).await;
                }
                return Err(StepError::OutOfOrder {
                    index,
                    name: name.to_owned(),
                });
            }
        }
        started.map(|(start, _)| start)
    }

    /// What is known of the step before step `index` (named `last`): that
    /// it completed, or [`StepError::Unfinished`].
    async fn before_step<E>(
        &self,
        index: usize,
        last: Option<String>,
    ) -> Result<Before, StepError<E>> {
        let before = *self.before.lock().unwrap_or_else(|e| e.into_inner());
        let last = match (before, last) {
            (Before::Claimed, Some(last)) => last,
            (Before::Skipped, Some(last)) => {
                return Err(StepError::Unfinished {
                    index: index - 1,
                    name: last,
                })
            }
            _ => return Ok(before),
        };
        // Claimed by this run; completed since, by `step_done` or in the
        // caller's own transaction?
        let key = step_record_key(self.claim.operation_id, index - 1);
        match self.store.get(&self.claim.scope, &key).await {
            Ok(Some(Record {
                state: RecordState::Completed { .. },
                ..
            })) => Ok(Before::CompletedHere),
            Ok(_) => Err(StepError::Unfinished {
                index: index - 1,
                name: last,
            }),
            Err(e) => Err(StepError::Store(e)),
        }
    }

    /// Notes that `step` completed in this run.
    fn completed_here(&self, step: &Step) {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if names.len() == step.index + 1 {
            *self.before.lock().unwrap_or_else(|e| e.into_inner()) = Before::CompletedHere;
        }
    }

    /// Claims step `index`, `name`: its stored output, or the step to run.
    async fn decide_step<T, E>(
        &self,
        name: &str,
        index: usize,
        before: Before,
    ) -> Result<(StepStart<T>, Before), StepError<E>>
    where
        T: DeserializeOwned,
    {
        let request = ClaimRequest {
            scope: self.claim.scope.clone(),
            key: step_record_key(self.claim.operation_id, index),
            fingerprint: step_fingerprint(name),
            lease: Duration::ZERO,
            retention: self.retention,
        };
        // An earlier attempt's step is waited for this long at most.
        let wait_until = Instant::now() + MAX_STEP_WAIT;
        let mut disagreements = 0u32;
        loop {
            // A step's lease ends with the operation's: a step never
            // outlives the claim it runs under.
            // Under a millisecond it is none: stores count whole
            // milliseconds, so the step would be claimed already free.
            let lease = self.lease_left();
            if lease < Duration::from_millis(1) {
                return Err(StepError::LeaseLost);
            }
            let request = ClaimRequest {
                lease,
                ..request.clone()
            };
            let record = match self.store.claim(&request).await {
                Ok(ClaimOutcome::Acquired(claim)) => {
                    // The claim waited (for a connection, for SQLite's
                    // writer, a pause) past the run's own lease: the run
                    // may be another's by now, and this step is not to
                    // start. It is let go at once for whoever has the run.
                    if self.lease_left().is_zero() {
                        if let Err(e) = self.store.release(&claim).await {
                            debug!(step = name, index, error = %e, "a step claimed past the run's lease was not let go; its lease ends it");
                        }
                        return Err(StepError::LeaseLost);
                    }
                    if self.claim.takeover {
                        self.check_remembered(&claim, &request, before, name, index)
                            .await?;
                    }
                    debug!(
                        step = name,
                        index,
                        takeover = claim.takeover,
                        "step claimed"
                    );
                    let step = Step {
                        name: name.to_owned(),
                        index,
                        key: step_key(self.claim.operation_id, name),
                        claim,
                    };
                    return Ok((StepStart::Run(step), Before::Claimed));
                }
                Ok(ClaimOutcome::Existing(record)) => record,
                Err(e) => return Err(StepError::Store(e)),
            };
            let now = UnixMillis::now();
            match self.existing_step(&record, &request.fingerprint, now) {
                Existing::Done(stored, _) if stored.status == FORGOTTEN => {
                    return Err(StepError::Forgotten {
                        index,
                        name: name.to_owned(),
                    });
                }
                Existing::Done(stored, completed_at) => {
                    debug!(
                        step = name,
                        index, "step done on an earlier run; its output replayed"
                    );
                    return serde_json::from_slice(&stored.body)
                        .map(|output| (StepStart::Done(output), Before::CompletedAt(completed_at)))
                        .map_err(|e| {
                            StepError::Codec(format!("the stored output of step {name:?}: {e}"))
                        });
                }
                Existing::OtherName => {
                    return Err(StepError::OutOfOrder {
                        index,
                        name: name.to_owned(),
                    })
                }
                Existing::HeldUntil(until) => {
                    // An earlier attempt's step, whose lease ends with that
                    // attempt's (over by now, unless it failed without
                    // releasing the step, or the clocks differ): wait a
                    // little, then say when to come back.
                    let left = now.until(until);
                    if Instant::now() >= wait_until {
                        return Err(StepError::InFlight {
                            retry_after: left.max(Duration::from_secs(1)),
                        });
                    }
                    let pause = left.clamp(Duration::from_millis(5), Duration::from_millis(100));
                    tokio::time::sleep(pause).await;
                }
                Existing::Disagree => {
                    disagreements += 1;
                    if disagreements > 5 {
                        return Err(StepError::InFlight {
                            retry_after: Duration::from_secs(1),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    /// In a run that took over, `claim` is a step's, just acquired, and
    /// `before` what is known of the step before it. The claim is only
    /// trusted to mean the step never completed if no record of the step
    /// can have expired yet: a record of it was made no earlier than the
    /// step before it completed (or the run's record was made, for the
    /// first step), and is kept a retention at least: the shortest any
    /// attempt of the run claimed it with (the run's record keeps it), not
    /// this attempt's, which a change of policy may have made longer. A step before it that
    /// this run claimed had not completed before, so no attempt got past
    /// it: nothing to check. Otherwise a record made a retention after that
    /// (this fresh one, or one a refusal left) is refused for good: the
    /// record is completed as forgotten, and were that to fail, the next
    /// run finds the same record, made as late.
    async fn check_remembered<E>(
        &self,
        claim: &Claim,
        request: &ClaimRequest,
        before: Before,
        name: &str,
        index: usize,
    ) -> Result<(), StepError<E>> {
        let completed_at = match before {
            // (Skipped never gets here: `before_step` refused it.)
            Before::Claimed | Before::CompletedHere | Before::Skipped => return Ok(()),
            Before::CompletedAt(at) => Some(at),
            Before::Nothing => None,
        };
        // The run's record: when it began, and the shortest retention any
        // attempt of it claimed it with. Each attempt kept the records it
        // made (its steps') for its own retention, so the shortest is what
        // they are all kept for at least; this attempt's may be longer.
        let run = match self.store.get(&self.claim.scope, &self.claim.key).await {
            Ok(Some(run)) if run.operation_id == self.claim.operation_id => run,
            Ok(_) => {
                // The run's record expired or was made anew: this run no
                // longer holds it.
                self.release_claim(claim, name).await;
                return Err(StepError::LeaseLost);
            }
            Err(e) => {
                self.release_claim(claim, name).await;
                return Err(StepError::Store(e));
            }
        };
        let since = completed_at.unwrap_or(run.created_at);
        let retention = run
            .shortest_retention
            .map_or(self.retention, |kept| kept.min(self.retention));
        let made = if claim.takeover {
            match self.store.get(&request.scope, &request.key).await {
                Ok(Some(step)) => step.created_at,
                Ok(None) => {
                    self.release_claim(claim, name).await;
                    return Err(StepError::LeaseLost);
                }
                Err(e) => {
                    self.release_claim(claim, name).await;
                    return Err(StepError::Store(e));
                }
            }
        } else {
            // Made just now: the store's clock as it made the claim.
            UnixMillis(
                claim
                    .locked_until
                    .0
                    .saturating_sub(idem_core::capped_millis(request.lease)),
            )
        };
        let margin = CLOCK_MARGIN.min(retention / 20);
        if made.plus(margin) < since.plus(retention) {
            return Ok(());
        }
        warn!(
            step = name,
            index,
            operation_id = %self.claim.operation_id,
            "step has no record older than its retention in a run that outlived it: it may have run before; refused"
        );
        let forgotten = StoredResponse {
            status: FORGOTTEN,
            headers: vec![(STEP_NAME_HEADER.into(), name.as_bytes().to_vec())],
            body: bytes::Bytes::from_static(FORGOTTEN_BODY),
        };
        if let Err(e) =
            crate::run::complete_retrying(self.store, claim, &forgotten, self.deadline).await
        {
            warn!(error = %e, step = name, "the forgotten step's record could not be completed; it frees with the operation's lease");
        }
        Err(StepError::Forgotten {
            index,
            name: name.to_owned(),
        })
    }

    /// Releases a step's claim, warning if that fails.
    async fn release_claim(&self, claim: &Claim, name: &str) {
        if let Err(e) = self.store.release(claim).await {
            warn!(error = %e, step = name, "step release failed; it frees with the operation's lease");
        }
    }

    /// What a step's existing record says.
    fn existing_step(
        &self,
        record: &Record,
        fingerprint: &Fingerprint,
        now: UnixMillis,
    ) -> Existing {
        if record.is_expired(now) {
            return Existing::Disagree;
        }
        if record.fingerprint != *fingerprint {
            return Existing::OtherName;
        }
        match &record.state {
            RecordState::Completed {
                response,
                completed_at,
            } => Existing::Done(response.clone(), *completed_at),
            RecordState::InProgress { locked_until, .. } if *locked_until > now => {
                Existing::HeldUntil(*locked_until)
            }
            RecordState::InProgress { .. } => Existing::Disagree,
        }
    }

    /// Stores `output` as `step`'s (fenced by the step's token).
    pub async fn step_done<T: Serialize, E>(
        &self,
        step: &Step,
        output: &T,
    ) -> Result<(), StepError<E>> {
        let stored = match step.stored(output) {
            Ok(stored) => stored,
            Err(e) => {
                self.release_step(step).await;
                return Err(StepError::Codec(e.to_string()));
            }
        };
        match crate::run::complete_retrying(self.store, &step.claim, &stored, self.deadline).await {
            Ok(()) => {
                self.completed_here(step);
                Ok(())
            }
            Err(StoreError::ClaimLost) => Err(StepError::LeaseLost),
            Err(e) => Err(StepError::Store(e)),
        }
    }

    /// After `step`'s claim was completed in the caller's own transaction
    /// (see [`Step::claim`]) and that transaction committed: tells caches in
    /// front of the store ([`Store::settled`]) and notes the step done, so
    /// that the next step starts without asking the store whether it is.
    pub async fn step_committed(&self, step: &Step) {
        self.completed_here(step);
        self.store.settled(&step.claim).await;
    }

    /// Releases `step` unfinished: the next run calls it again (under the
    /// same step key).
    pub async fn release_step(&self, step: &Step) {
        self.release_claim(&step.claim, &step.name).await;
    }
}

/// What a step's existing record says.
enum Existing {
    /// Completed, at this time.
    Done(StoredResponse, UnixMillis),
    OtherName,
    HeldUntil(UnixMillis),
    Disagree,
}

/// Rolls `tx` back now, before answering.
async fn rollback<S: BeginTransaction + ?Sized>(tx: S::Transaction) {
    if let Err(e) = S::rollback(tx).await {
        warn!(error = %e, "rollback failed (the connection is gone, and the transaction with it)");
    }
}
