//! The cases about time: leases that run out, releases, retention, sweeps
//! and expiry.

use super::*;

/// After the lease runs out, a retry takes over: new token, same operation.
pub async fn takeover_after_lease_expiry<S: Store>(store: S) {
    let r = req("k4", SHORT);
    let first = acquired(store.claim(&r).await.unwrap());
    assert!(matches!(
        store.claim(&r).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let second = acquired(store.claim(&r).await.unwrap());
    assert!(second.takeover);
    assert_ne!(second.token, first.token);
    assert_eq!(second.operation_id, first.operation_id);
    assert!(second.locked_until > first.locked_until);
}

/// Many retries racing for an expired lease: exactly one takes it over.
pub async fn racing_takeovers_only_one_wins<S: Store>(store: S) {
    let store = Arc::new(store);
    let r = Arc::new(req("k5", SHORT));
    let first = acquired(store.claim(&r).await.unwrap());
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let long = Arc::new(req("k5", LONG));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (store, r) = (store.clone(), long.clone());
        tasks.push(tokio::spawn(async move { store.claim(&r).await }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        if let ClaimOutcome::Acquired(c) = t.await.unwrap().unwrap() {
            winners.push(c);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one retry may take over");
    assert!(winners[0].takeover);
    assert_eq!(winners[0].operation_id, first.operation_id);
}

/// A holder whose claim was taken over can neither complete nor release.
pub async fn stale_token_cannot_complete_or_release<S: Store>(store: S) {
    let r = req("k6", SHORT);
    let zombie = acquired(store.claim(&r).await.unwrap());
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let fresh = acquired(store.claim(&req("k6", LONG)).await.unwrap());
    assert!(matches!(
        store
            .complete(&zombie, &response(r#"{"zombie":true}"#))
            .await,
        Err(StoreError::ClaimLost)
    ));
    assert!(matches!(
        store.release(&zombie).await,
        Err(StoreError::ClaimLost)
    ));
    // the record is still the new holder's
    match existing(store.claim(&r).await.unwrap()).state {
        RecordState::InProgress { token, .. } => assert_eq!(token, fresh.token),
        other => panic!("expected in progress, got {other:?}"),
    }
    store
        .complete(&fresh, &response(r#"{"fresh":true}"#))
        .await
        .unwrap();
    match store.get("scope-a", "k6").await.unwrap().unwrap().state {
        RecordState::Completed { response: got, .. } => assert_eq!(got.body, r#"{"fresh":true}"#),
        other => panic!("expected completed, got {other:?}"),
    }
    // Nor complete it with the very response its successor stored: a
    // completion stands again only under the token that made it.
    assert!(matches!(
        store
            .complete(&zombie, &response(r#"{"fresh":true}"#))
            .await,
        Err(StoreError::ClaimLost)
    ));
    // and the zombie cannot release a completed record either
    assert!(matches!(
        store.release(&zombie).await,
        Err(StoreError::ClaimLost)
    ));
    assert!(matches!(
        store.release(&fresh).await,
        Err(StoreError::ClaimLost)
    ));
}

/// A released claim is taken over at once by the next retry, which keeps the
/// operation id (so downstream effects stay deduplicated).
pub async fn release_lets_next_claim_take_over<S: Store>(store: S) {
    let r = req("k7", LONG);
    let first = acquired(store.claim(&r).await.unwrap());
    store.release(&first).await.unwrap();
    let second = acquired(store.claim(&r).await.unwrap());
    assert!(second.takeover);
    assert_eq!(second.operation_id, first.operation_id);
    assert_ne!(second.token, first.token);
    // the first holder's token is spent
    assert!(matches!(
        store.release(&first).await,
        Err(StoreError::ClaimLost)
    ));
    assert!(matches!(
        store.claim(&r).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
}

/// An expired lease is not taken over by a request with another fingerprint.
pub async fn expired_lease_with_other_fingerprint_is_not_taken_over<S: Store>(store: S) {
    let r = req("k8", SHORT);
    let first = acquired(store.claim(&r).await.unwrap());
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let other = request(
        "scope-a",
        "k8",
        r#"{"amount":1}"#,
        LONG,
        Duration::from_secs(3600),
    );
    let rec = existing(store.claim(&other).await.unwrap());
    assert_eq!(rec.fingerprint, r.fingerprint);
    assert_eq!(rec.operation_id, first.operation_id);
}

/// After its retention a record reads as absent and its key is new again,
/// whatever the body.
pub async fn retention_makes_key_new_again<S: Store>(store: S) {
    let retention = Duration::from_millis(600);
    let r = request("scope-a", "k9", r#"{"amount":1}"#, SHORT, retention);
    let first = acquired(store.claim(&r).await.unwrap());
    store.complete(&first, &response("{}")).await.unwrap();
    assert!(store.get("scope-a", "k9").await.unwrap().is_some());
    tokio::time::sleep(retention + Duration::from_millis(150)).await;
    assert_eq!(store.get("scope-a", "k9").await.unwrap(), None);
    let other = request(
        "scope-a",
        "k9",
        r#"{"amount":2}"#,
        LONG,
        Duration::from_secs(3600),
    );
    let second = acquired(store.claim(&other).await.unwrap());
    assert!(!second.takeover);
    assert_ne!(second.operation_id, first.operation_id);
    let rec = store.get("scope-a", "k9").await.unwrap().unwrap();
    assert_eq!(rec.fingerprint, other.fingerprint);
    assert!(matches!(rec.state, RecordState::InProgress { .. }));
}

/// A takeover near the end of a record's retention keeps the record for
/// another retention from the takeover: the answer it completes is
/// replayed after the first retention would have ended, where otherwise the
/// key would be new again and the work run once more under a new
/// operation id.
pub async fn a_takeover_keeps_the_record_another_retention<S: Store>(store: S) {
    let retention = Duration::from_secs(3);
    let lease = Duration::from_secs(1);
    let start = tokio::time::Instant::now();
    let r = request("scope-a", "k-late", r#"{"amount":1}"#, lease, retention);
    let first = acquired(store.claim(&r).await.unwrap());
    // The holder dies; a retry takes over late in the retention.
    tokio::time::sleep_until(start + Duration::from_millis(2500)).await;
    let second = acquired(store.claim(&r).await.unwrap());
    let taken_over = tokio::time::Instant::now();
    assert!(second.takeover);
    assert_eq!(second.operation_id, first.operation_id);
    store
        .complete(&second, &response("{\"late\":1}"))
        .await
        .unwrap();
    // Past the first retention, well within one from the takeover.
    tokio::time::sleep_until(start + retention + Duration::from_millis(300)).await;
    assert!(
        taken_over.elapsed() < retention - Duration::from_millis(500),
        "the machine stalled past the case's margin"
    );
    let rec = store.get("scope-a", "k-late").await.unwrap();
    let rec = rec.expect("the completed record outlives the first retention");
    assert!(matches!(rec.state, RecordState::Completed { .. }));
    let replay = existing(store.claim(&r).await.unwrap());
    assert_eq!(replay.operation_id, first.operation_id);
}

/// The record keeps the shortest retention any claim of it asked for: a
/// takeover asking for more keeps the record longer but not that; one
/// asking for less lowers it; a record replaced whole past its retention
/// starts again from its new claim's.
pub async fn the_shortest_retention_any_claim_asked_for_is_kept<S: Store>(store: S) {
    let kept = async |key: &str| {
        let record = store.get("scope-r", key).await.unwrap();
        record.expect("the record is there").shortest_retention
    };
    let minute = Duration::from_secs(60);
    let claim = |key: &str, lease: Duration, retention: Duration| {
        request("scope-r", key, r#"{"amount":1}"#, lease, retention)
    };
    let first = acquired(store.claim(&claim("k", LONG, minute)).await.unwrap());
    assert_eq!(kept("k").await, Some(minute));
    store.release(&first).await.unwrap();
    let longer = acquired(store.claim(&claim("k", LONG, minute * 60)).await.unwrap());
    assert!(longer.takeover);
    assert_eq!(
        kept("k").await,
        Some(minute),
        "raised by a longer retention"
    );
    store.release(&longer).await.unwrap();
    let shorter = acquired(store.claim(&claim("k", LONG, minute / 2)).await.unwrap());
    assert!(shorter.takeover);
    assert_eq!(kept("k").await, Some(minute / 2));
    store.complete(&shorter, &response("{}")).await.unwrap();
    assert_eq!(
        kept("k").await,
        Some(minute / 2),
        "changed by the completion"
    );

    let short = Duration::from_millis(400);
    let old = acquired(
        store
            .claim(&claim("k2", Duration::from_millis(100), short))
            .await
            .unwrap(),
    );
    store.complete(&old, &response("{}")).await.unwrap();
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    let anew = acquired(store.claim(&claim("k2", LONG, minute)).await.unwrap());
    assert!(!anew.takeover);
    assert_ne!(anew.operation_id, old.operation_id);
    assert_eq!(kept("k2").await, Some(minute), "a record made anew");
}

/// Sweep deletes expired records in bounded batches and nothing else.
pub async fn sweep_removes_only_expired_in_batches<S: Store>(store: S) {
    let short = Duration::from_millis(400);
    for i in 0..7 {
        let r = request(
            "scope-s",
            &format!("old-{i}"),
            "{}",
            Duration::from_millis(100),
            short,
        );
        let c = acquired(store.claim(&r).await.unwrap());
        if i % 2 == 0 {
            store.complete(&c, &response("{}")).await.unwrap();
        }
    }
    // a record past retention but still held under a live lease is kept
    let held = request(
        "scope-s",
        "held",
        "{}",
        Duration::from_secs(5),
        Duration::from_millis(450),
    );
    let held_claim = acquired(store.claim(&held).await.unwrap());
    for i in 0..3 {
        let r = request(
            "scope-s",
            &format!("live-{i}"),
            "{}",
            LONG,
            Duration::from_secs(3600),
        );
        acquired(store.claim(&r).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let first = store.sweep(3).await.unwrap();
    assert_eq!(first, 3, "a batch is bounded");
    let rest = sweep_all(&store, 3).await.unwrap();
    assert_eq!(first + rest, 7);
    assert_eq!(store.sweep(3).await.unwrap(), 0);
    for i in 0..3 {
        assert!(store
            .get("scope-s", &format!("live-{i}"))
            .await
            .unwrap()
            .is_some());
    }
    assert!(store.get("scope-s", "held").await.unwrap().is_some());
    store.complete(&held_claim, &response("{}")).await.unwrap();
}

/// For stores that expire records natively: expired records are gone
/// without a sweep, live ones (and one past retention under a live lease)
/// stay, and the sweep never removes anything live.
pub async fn expired_records_vanish_by_themselves<S: Store>(store: S) {
    let short = Duration::from_millis(400);
    for i in 0..3 {
        let r = request(
            "scope-s",
            &format!("old-{i}"),
            "{}",
            Duration::from_millis(100),
            short,
        );
        let c = acquired(store.claim(&r).await.unwrap());
        store.complete(&c, &response("{}")).await.unwrap();
    }
    let held = request(
        "scope-s",
        "held",
        "{}",
        Duration::from_secs(5),
        Duration::from_millis(450),
    );
    let held_claim = acquired(store.claim(&held).await.unwrap());
    let live = request("scope-s", "live", "{}", LONG, Duration::from_secs(3600));
    acquired(store.claim(&live).await.unwrap());
    tokio::time::sleep(Duration::from_millis(700)).await;
    sweep_all(&store, 3).await.unwrap();
    for i in 0..3 {
        assert_eq!(
            store.get("scope-s", &format!("old-{i}")).await.unwrap(),
            None
        );
    }
    assert!(store.get("scope-s", "live").await.unwrap().is_some());
    assert!(store.get("scope-s", "held").await.unwrap().is_some());
    store.complete(&held_claim, &response("{}")).await.unwrap();
}
