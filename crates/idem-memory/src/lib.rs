//! An in-memory [`Store`] for tests and examples.
//!
//! Records live in a `HashMap` (by scope, then key, so that a lookup copies
//! neither) behind one mutex; each operation holds the lock for its whole
//! read-decide-write, which makes it atomic. Nothing survives
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

/// The records by scope, then by key.
type Records = HashMap<String, HashMap<String, Entry>>;

/// A record, and the token of its last claim (a completed record keeps it,
/// so that its holder's completion, sent again, is known as its own).
#[derive(Debug)]
struct Entry {
    record: Record,
    token: FencingToken,
}

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
        self.lock().values().map(HashMap::len).sum()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.lock().values().all(HashMap::is_empty)
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
        let stored = records
            .get_mut(req.scope.as_str())
            .and_then(|scoped| scoped.get_mut(req.key.as_str()));
        let arrival = on_arrival(
            &DECIDING,
            stored.as_ref().map(|e| &e.record),
            &req.fingerprint,
            now,
        );
        let locked_until = now.plus(req.lease);
        let token = FencingToken::generate();
        let record = match (arrival, stored) {
            (Arrival::TakeOver, Some(entry)) => {
                entry.token = token;
                let record = &mut entry.record;
                record.state = RecordState::InProgress {
                    token,
                    locked_until,
                };
                // Kept for at least another retention: an answer the
                // takeover completes late is kept, not lost with a record
                // already due to expire.
                record.expires_at = record.expires_at.max(now.plus(req.retention));
                record.shortest_retention = record
                    .shortest_retention
                    .map(|kept| kept.min(req.retention));
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
                shortest_retention: Some(req.retention),
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
            ) => return ClaimOutcome::Existing(existing.record.clone()),
        };
        let claim = Claim {
            scope: req.scope.clone(),
            key: req.key.clone(),
            token,
            operation_id: record.operation_id,
            locked_until,
            takeover: false,
        };
        let entry = Entry { record, token };
        match records.get_mut(req.scope.as_str()) {
            Some(scoped) => {
                scoped.insert(req.key.clone(), entry);
            }
            None => {
                let scoped = HashMap::from([(req.key.clone(), entry)]);
                records.insert(req.scope.clone(), scoped);
            }
        }
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
        let held = records
            .get_mut(claim.scope.as_str())
            .and_then(|scoped| scoped.get_mut(claim.key.as_str()));
        match held {
            Some(e) if matches!(e.record.state, RecordState::InProgress { token, .. } if token == claim.token) =>
            {
                f(&mut e.record, now);
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
        let result = self
            .with_held(claim, |r, now| {
                r.state = RecordState::Completed {
                    response: response.clone(),
                    completed_at: now,
                };
            })
            .or_else(|lost| {
                // The same completion again (as every store, though in
                // memory none is lost on its way back): it stands.
                let records = self.lock();
                let entry = records
                    .get(claim.scope.as_str())
                    .and_then(|scoped| scoped.get(claim.key.as_str()));
                match entry {
                    Some(e)
                        if e.token == claim.token
                            && matches!(&e.record.state, RecordState::Completed { response: stored, .. } if stored == response) =>
                    {
                        Ok(())
                    }
                    _ => Err(lost),
                }
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
            .get(scope)
            .and_then(|scoped| scoped.get(key))
            .map(|e| &e.record)
            .filter(|r| !r.is_expired(now))
            .cloned();
        Box::pin(async move { Ok(record) })
    }

    fn sweep(&self, batch: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        let now = UnixMillis::now();
        let mut records = self.lock();
        let mut swept = 0;
        for scoped in records.values_mut() {
            scoped.retain(|_, e| {
                let sweep = swept < batch && e.record.is_expired(now);
                swept += usize::from(sweep);
                !sweep
            });
        }
        records.retain(|_, scoped| !scoped.is_empty());
        let n = swept as u64;
        Box::pin(async move { Ok(n) })
    }
}

#[cfg(test)]
mod tests {
    idem_store_suite::store_suite!(|| async { (crate::MemoryStore::new(), ()) });

    use std::time::Duration;

    use super::*;
    use idem_core::Fingerprint;

    /// Records are counted across scopes, and a sweep leaves no empty scope.
    #[tokio::test]
    async fn len_counts_every_scope_and_a_sweep_empties_them() {
        let store = MemoryStore::new();
        assert!(store.is_empty());
        for (scope, key) in [("a", "1"), ("a", "2"), ("b", "1")] {
            let request = ClaimRequest {
                scope: scope.into(),
                key: key.into(),
                fingerprint: Fingerprint::from_bytes([1; 32]),
                lease: Duration::ZERO,
                retention: Duration::ZERO,
            };
            assert!(matches!(
                store.claim(&request).await,
                Ok(ClaimOutcome::Acquired(_))
            ));
        }
        assert_eq!(store.len(), 3);
        assert!(!store.is_empty());
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(store.sweep(2).await.unwrap(), 2);
        assert_eq!(store.len(), 1);
        assert_eq!(store.sweep(2).await.unwrap(), 1);
        assert!(store.is_empty());
        assert!(store.lock().is_empty(), "no empty scope is left behind");
    }
}
