//! The conformance suite every idem [`Store`] passes, written once.
//!
//! A store crate instantiates it in its tests with a closure that makes a
//! fresh, isolated store (its own file, schema or key prefix) and a guard
//! that is kept alive for the test and dropped after it (a temporary
//! directory, a schema to drop; `()` when there is nothing to clean up):
//!
//! ```text
//! idem_store_suite::store_suite!(|| async { (MyStore::connect(...).await.unwrap(), ()) });
//! ```
//!
//! Each case is a plain `async fn` taking the store, so a store with special
//! needs can also call them one by one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod leases;
pub mod transactional;

pub use leases::*;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    sweep_all, Claim, ClaimOutcome, ClaimRequest, Fingerprint, RecordState, Store, StoreError,
    StoredResponse,
};

/// A lease long enough never to run out during a test.
pub const LONG: Duration = Duration::from_secs(600);
/// A lease short enough to wait out.
pub const SHORT: Duration = Duration::from_millis(300);

/// Instantiates every case of the suite as a `#[tokio::test]`, each with a
/// fresh store from `$make` (a closure returning a future of
/// `(store, guard)`; the guard lives until the case ends).
#[macro_export]
macro_rules! store_suite {
    // Stores whose records expire by themselves (Redis): the sweep has
    // nothing to do, and expired records must vanish on their own.
    ($make:expr, native_expiry) => {
        $crate::store_suite!(@cases $make;
            fresh_claim_then_existing,
            racing_claims_only_one_wins,
            complete_then_replay,
            different_fingerprint_is_left_alone,
            takeover_after_lease_expiry,
            racing_takeovers_only_one_wins,
            stale_token_cannot_complete_or_release,
            release_lets_next_claim_take_over,
            expired_lease_with_other_fingerprint_is_not_taken_over,
            retention_makes_key_new_again,
            a_takeover_keeps_the_record_another_retention,
            the_shortest_retention_any_claim_asked_for_is_kept,
            expired_records_vanish_by_themselves,
            scopes_are_isolated,
            the_longest_scope_and_key_are_kept,
            responses_round_trip,
            get_missing_is_none
        );
    };
    ($make:expr) => {
        $crate::store_suite!(@cases $make;
            fresh_claim_then_existing,
            racing_claims_only_one_wins,
            complete_then_replay,
            different_fingerprint_is_left_alone,
            takeover_after_lease_expiry,
            racing_takeovers_only_one_wins,
            stale_token_cannot_complete_or_release,
            release_lets_next_claim_take_over,
            expired_lease_with_other_fingerprint_is_not_taken_over,
            retention_makes_key_new_again,
            a_takeover_keeps_the_record_another_retention,
            the_shortest_retention_any_claim_asked_for_is_kept,
            sweep_removes_only_expired_in_batches,
            scopes_are_isolated,
            the_longest_scope_and_key_are_kept,
            responses_round_trip,
            get_missing_is_none
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let make = $make;
                let (store, guard) = make().await;
                $crate::$case(store).await;
                drop(guard);
            }
        )*
    };
}

/// A claim request for `key` in scope `scope` with body `body`.
pub fn request(
    scope: &str,
    key: &str,
    body: &str,
    lease: Duration,
    retention: Duration,
) -> ClaimRequest {
    ClaimRequest {
        scope: scope.to_owned(),
        key: key.to_owned(),
        fingerprint: Fingerprint::of_request(
            "POST",
            "/payments",
            Some("application/json"),
            body.as_bytes(),
        ),
        lease,
        retention,
    }
}

fn req(key: &str, lease: Duration) -> ClaimRequest {
    request(
        "scope-a",
        key,
        r#"{"amount":100}"#,
        lease,
        Duration::from_secs(3600),
    )
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("location".to_owned(), b"/payments/1".to_vec()),
            ("content-type".to_owned(), b"application/json".to_vec()),
        ],
        body: Bytes::from_static(body.as_bytes()),
    }
}

fn acquired(o: ClaimOutcome) -> Claim {
    match o {
        ClaimOutcome::Acquired(c) => c,
        ClaimOutcome::Existing(r) => panic!("expected to acquire, found {r:?}"),
    }
}

fn existing(o: ClaimOutcome) -> idem_core::Record {
    match o {
        ClaimOutcome::Existing(r) => r,
        ClaimOutcome::Acquired(c) => panic!("expected an existing record, acquired {c:?}"),
    }
}

/// A new key is acquired; a second claim finds the record in progress.
pub async fn fresh_claim_then_existing<S: Store>(store: S) {
    let r = req("k1", LONG);
    let claim = acquired(store.claim(&r).await.unwrap());
    assert!(!claim.takeover);
    assert_eq!(claim.key, "k1");
    let rec = existing(store.claim(&r).await.unwrap());
    assert_eq!(rec.operation_id, claim.operation_id);
    assert_eq!(rec.fingerprint, r.fingerprint);
    match rec.state {
        RecordState::InProgress {
            token,
            locked_until,
        } => {
            assert_eq!(token, claim.token);
            assert_eq!(locked_until, claim.locked_until);
        }
        other => panic!("expected in progress, got {other:?}"),
    }
}

/// Many concurrent claims of one key: exactly one acquires it.
pub async fn racing_claims_only_one_wins<S: Store>(store: S) {
    let store = Arc::new(store);
    let r = Arc::new(req("race", LONG));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (store, r) = (store.clone(), r.clone());
        tasks.push(tokio::spawn(async move { store.claim(&r).await }));
    }
    let mut won = 0;
    let mut op_ids = std::collections::HashSet::new();
    for t in tasks {
        match t.await.unwrap().unwrap() {
            ClaimOutcome::Acquired(c) => {
                won += 1;
                op_ids.insert(c.operation_id);
            }
            ClaimOutcome::Existing(rec) => {
                op_ids.insert(rec.operation_id);
            }
        }
    }
    assert_eq!(won, 1, "exactly one racing claim must win");
    assert_eq!(op_ids.len(), 1, "every racer must see the same operation");
}

/// A completed record is returned as existing with its response.
pub async fn complete_then_replay<S: Store>(store: S) {
    let r = req("k2", LONG);
    let claim = acquired(store.claim(&r).await.unwrap());
    store
        .complete(&claim, &response(r#"{"id":"p1"}"#))
        .await
        .unwrap();
    let rec = existing(store.claim(&r).await.unwrap());
    match &rec.state {
        RecordState::Completed { response: got, .. } => {
            assert_eq!(got, &response(r#"{"id":"p1"}"#))
        }
        other => panic!("expected completed, got {other:?}"),
    }
    assert_eq!(store.get("scope-a", "k2").await.unwrap(), Some(rec.clone()));
    // The same completion sent again (its answer was lost on the way back,
    // and the holder tried again) stands: it landed. Nothing changes.
    store
        .complete(&claim, &response(r#"{"id":"p1"}"#))
        .await
        .unwrap();
    assert_eq!(store.get("scope-a", "k2").await.unwrap(), Some(rec.clone()));
    // Another response under the spent claim is refused.
    assert!(matches!(
        store.complete(&claim, &response("{}")).await,
        Err(StoreError::ClaimLost)
    ));
    assert_eq!(store.get("scope-a", "k2").await.unwrap(), Some(rec));
}

/// A claim with another fingerprint does not touch the record.
pub async fn different_fingerprint_is_left_alone<S: Store>(store: S) {
    let r = req("k3", LONG);
    let claim = acquired(store.claim(&r).await.unwrap());
    let other = request(
        "scope-a",
        "k3",
        r#"{"amount":999}"#,
        LONG,
        Duration::from_secs(3600),
    );
    let rec = existing(store.claim(&other).await.unwrap());
    assert_eq!(rec.fingerprint, r.fingerprint);
    assert_ne!(rec.fingerprint, other.fingerprint);
    // the holder still holds it
    store.complete(&claim, &response("{}")).await.unwrap();
}

/// The same key in two scopes names two records.
pub async fn scopes_are_isolated<S: Store>(store: S) {
    let a = request("tenant-a", "same", "{}", LONG, Duration::from_secs(3600));
    let b = request("tenant-b", "same", "{}", LONG, Duration::from_secs(3600));
    let ca = acquired(store.claim(&a).await.unwrap());
    let cb = acquired(store.claim(&b).await.unwrap());
    assert_ne!(ca.operation_id, cb.operation_id);
    store.complete(&ca, &response("a")).await.unwrap();
    assert!(matches!(
        store.get("tenant-b", "same").await.unwrap().unwrap().state,
        RecordState::InProgress { .. }
    ));
}

/// A scope of [`MAX_SCOPE_LEN`](idem_core::MAX_SCOPE_LEN) bytes (multi-byte
/// characters among them) beside a key of
/// [`MAX_KEY_LEN`](idem_core::MAX_KEY_LEN): claimed, completed, read back,
/// told apart from the scope one byte shorter.
pub async fn the_longest_scope_and_key_are_kept<S: Store>(store: S) {
    let mut scope = "é".repeat(idem_core::MAX_SCOPE_LEN / 4);
    scope.push_str(&"s".repeat(idem_core::MAX_SCOPE_LEN - scope.len()));
    assert_eq!(scope.len(), idem_core::MAX_SCOPE_LEN);
    let shorter = &scope[..scope.len() - 1];
    let key = "k".repeat(idem_core::MAX_KEY_LEN);
    let long = request(&scope, &key, "{}", LONG, Duration::from_secs(3600));
    let claim = acquired(store.claim(&long).await.unwrap());
    store.complete(&claim, &response("long")).await.unwrap();
    let record = store.get(&scope, &key).await.unwrap().unwrap();
    assert_eq!(
        (record.scope.as_str(), record.key.as_str()),
        (scope.as_str(), key.as_str())
    );
    assert!(matches!(record.state, RecordState::Completed { .. }));
    assert_eq!(store.get(shorter, &key).await.unwrap(), None);
    let other = request(shorter, &key, "{}", LONG, Duration::from_secs(3600));
    acquired(store.claim(&other).await.unwrap());
}

/// Statuses, binary header values and bodies come back exactly.
pub async fn responses_round_trip<S: Store>(store: S) {
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let cases = [
        StoredResponse {
            status: 422,
            headers: vec![],
            body: Bytes::new(),
        },
        StoredResponse {
            status: 200,
            headers: vec![
                ("x-bin".to_owned(), vec![0x80, 0xff, 0x00]),
                ("etag".to_owned(), b"\"v1\"".to_vec()),
                ("x-empty".to_owned(), vec![]),
            ],
            body: Bytes::from(big),
        },
    ];
    for (i, want) in cases.into_iter().enumerate() {
        let key = format!("rt-{i}");
        let c = acquired(store.claim(&req(&key, LONG)).await.unwrap());
        store.complete(&c, &want).await.unwrap();
        match store.get("scope-a", &key).await.unwrap().unwrap().state {
            RecordState::Completed { response, .. } => assert_eq!(response, want),
            other => panic!("expected completed, got {other:?}"),
        }
    }
}

/// Reading an unknown key gives nothing.
pub async fn get_missing_is_none<S: Store>(store: S) {
    assert_eq!(store.get("nobody", "nothing").await.unwrap(), None);
}
