//! An in-memory [`Store`] for tests and examples.
//!
//! Records live in a `HashMap` behind one mutex; each operation holds the lock
//! for its whole read-decide-write, which makes it atomic. Nothing survives
//! the process, and two processes do not share it: use the SQLite or
//! PostgreSQL store for anything real.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Fingerprint, Store};
//! use idem_memory::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem_core::StoreError> {
//! let store = MemoryStore::new();
//! let request = ClaimRequest {
//!     scope: "client-1".into(),
//!     key: "key-1".into(),
//!     fingerprint: Fingerprint::of_request("POST", "/payments", None, b"{}"),
//!     lease: Duration::from_secs(30),
//!     retention: Duration::from_secs(86_400),
//! };
//! assert!(matches!(store.claim(&request).await?, ClaimOutcome::Acquired(_)));
//! assert!(matches!(store.claim(&request).await?, ClaimOutcome::Existing(_)));
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};

use idem_core::{
    on_arrival, Arrival, BoxFuture, Claim, ClaimOutcome, ClaimRequest, FencingToken, OperationId,
    Policy, Record, RecordState, Store, StoreError, StoredResponse, UnixMillis,
};

type Records = HashMap<(String, String), Record>;

/// An in-memory store; see the crate-level docs.
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<Records>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records the store holds, expired ones included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // A panic while holding the lock cannot leave a record half-written
        // (each write is one map operation), so a poisoned lock is safe to use.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn claim_now(&self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        // The decision needs no settings of the layer's (whether to wait is
        // the caller's business): the defaults, built once.
        static DECIDING: LazyLock<Policy> = LazyLock::new(Policy::default);
        let mut records = self.lock();
        let id = (req.scope.clone(), req.key.clone());
        let stored = records.get_mut(&id);
        let arrival = on_arrival(&DECIDING, stored.as_deref(), &req.fingerprint, now);
        let locked_until = now.plus(req.lease);
        let token = FencingToken::generate();
        let record = match (arrival, stored) {
            (Arrival::TakeOver, Some(record)) => {
                record.state = RecordState::InProgress {
                    token,
                    locked_until,
                };
                return ClaimOutcome::Acquired(Claim {
                    scope: req.scope.clone(),
                    key: req.key.clone(),
                    token,
                    operation_id: record.operation_id,
                    locked_until,
                    takeover: true,
                });
            }
            (Arrival::Run, _) | (_, None) => Record {
                scope: req.scope.clone(),
                key: req.key.clone(),
                fingerprint: req.fingerprint,
                operation_id: OperationId::generate(),
                created_at: now,
                expires_at: now.plus(req.retention),
                state: RecordState::InProgress {
                    token,
                    locked_until,
                },
            },
            (
                Arrival::Replay
                | Arrival::Conflict { .. }
                | Arrival::Wait { .. }
                | Arrival::Mismatch,
                Some(existing),
            ) => return ClaimOutcome::Existing(existing.clone()),
        };
        let claim = Claim {
            scope: req.scope.clone(),
            key: req.key.clone(),
            token,
            operation_id: record.operation_id,
            locked_until,
            takeover: false,
        };
        records.insert(id, record);
        ClaimOutcome::Acquired(claim)
    }

    /// Applies `f` to the record if it is in progress under `claim.token`.
    fn with_held(
        &self,
        claim: &Claim,
        f: impl FnOnce(&mut Record, UnixMillis),
    ) -> Result<(), StoreError> {
        let mut records = self.lock();
        let now = UnixMillis::now();
        match records.get_mut(&(claim.scope.clone(), claim.key.clone())) {
            Some(r) if matches!(r.state, RecordState::InProgress { token, .. } if token == claim.token) =>
            {
                f(r, now);
                Ok(())
            }
            _ => Err(StoreError::ClaimLost),
        }
    }
}

impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        let outcome = self.claim_now(request, UnixMillis::now());
        Box::pin(async move { Ok(outcome) })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let result = self.with_held(claim, |r, now| {
            r.state = RecordState::Completed {
                response: response.clone(),
                completed_at: now,
            };
        });
        Box::pin(async move { result })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> BoxFuture<'a, Result<(), StoreError>> {
        let result = self.with_held(claim, |r, now| {
            if let RecordState::InProgress { locked_until, .. } = &mut r.state {
                *locked_until = now;
            }
        });
        Box::pin(async move { result })
    }

    fn get<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        let now = UnixMillis::now();
        let record = self
            .lock()
            .get(&(scope.to_owned(), key.to_owned()))
            .filter(|r| !r.is_expired(now))
            .cloned();
        Box::pin(async move { Ok(record) })
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        let now = UnixMillis::now();
        let mut records = self.lock();
        let expired: Vec<_> = records
            .iter()
            .filter(|(_, r)| r.is_expired(now))
            .map(|(id, _)| id.clone())
            .take(batch)
            .collect();
        for id in &expired {
            records.remove(id);
        }
        let n = expired.len() as u64;
        Box::pin(async move { Ok(n) })
    }
}

#[cfg(test)]
mod tests {
    idem_store_suite::store_suite!(|| async { (crate::MemoryStore::new(), ()) });
}
