//! Unit tests of the store's pieces that need no server.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::conn::glob_escaped;

#[test]
fn patterns_in_a_prefix_match_only_themselves() {
    assert_eq!(glob_escaped("idem"), "idem");
    assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
}

/// A store on a fresh prefix of the Redis the tests use (`bash
/// scripts/test` starts it).
async fn store() -> RedisStore {
    let url = std::env::var("IDEM_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    RedisStore::connect(
        RedisConfig::new(url).prefix(format!("idem-unit-{}", uuid::Uuid::new_v4().simple())),
    )
    .await
    .expect("Redis is up (`bash scripts/test` starts it)")
}

#[tokio::test]
async fn a_claim_sent_twice_is_won_twice_not_a_conflict_with_itself() {
    let store = store().await;
    let key = store.record_key("s", "k");
    let token = FencingToken::generate();
    let claim_once = || {
        let mut conn = store.conn.clone();
        let (op, tok) = (OperationId::generate().0.to_string(), token.0.to_string());
        let key = key.clone();
        let store = &store;
        async move {
            let args: [&[u8]; 7] = [
                b"s",
                b"k",
                b"fp",
                op.as_bytes(),
                tok.as_bytes(),
                b"30000",
                b"600000",
            ];
            let reply = eval_sha(&mut conn, &store.claim, scripts::CLAIM, &key, &args)
                .await
                .unwrap();
            let Value::Array(reply) = reply else {
                panic!("an array, not {reply:?}")
            };
            reply
        }
    };
    let first = claim_once().await;
    let again = claim_once().await;
    assert_eq!(bytes_of(&first[0]), Some(&b"won"[..]));
    assert_eq!(bytes_of(&again[0]), Some(&b"won"[..]), "{again:?}");
    assert_eq!(first[1], again[1], "the same operation id");
    store.clear().await.unwrap();
}

/// A claim whose first look was sent again after it claimed (its reply
/// lost) meets its own claim: won again, by the claim script, with the
/// same operation id and lease, not a conflict with itself; any other
/// token meets it as a claim in flight.
#[tokio::test]
async fn a_first_look_sent_twice_is_won_twice_not_a_conflict_with_itself() {
    let store = store().await;
    let req = ClaimRequest {
        scope: "s".into(),
        key: "k".into(),
        fingerprint: Fingerprint::from_bytes([4; 32]),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(600),
    };
    let (token, proposed) = (FencingToken::generate(), OperationId::generate());
    let first = store.claim_as(&req, token, proposed).await.unwrap();
    let again = store.claim_as(&req, token, proposed).await.unwrap();
    match (first, again) {
        (ClaimOutcome::Acquired(a), ClaimOutcome::Acquired(b)) => {
            assert_eq!(a.operation_id, b.operation_id);
            assert_eq!(a.locked_until, b.locked_until);
            assert!(!b.takeover, "{b:?}");
        }
        other => panic!("won twice: {other:?}"),
    }
    match store
        .claim_as(&req, FencingToken::generate(), OperationId::generate())
        .await
        .unwrap()
    {
        ClaimOutcome::Existing(record) => {
            assert!(matches!(record.state, RecordState::InProgress { token: t, .. } if t == token));
        }
        other => panic!("another token meets the claim in flight: {other:?}"),
    }
    store.clear().await.unwrap();
}

/// The first look answers exactly what the claim script would answer with
/// no write, and leaves the rest (past retention, a takeover) to it.
#[test]
fn the_first_look_decides_only_what_needs_no_write() {
    let fp = Fingerprint::from_bytes([1; 32]);
    let other = Fingerprint::from_bytes([2; 32]);
    let now = UnixMillis(10_000);
    let record = |fingerprint: Fingerprint, expires_at: i64, state: RecordState| Record {
        scope: "s".into(),
        key: "k".into(),
        fingerprint,
        operation_id: OperationId::generate(),
        created_at: UnixMillis(0),
        expires_at: UnixMillis(expires_at),
        shortest_retention: None,
        state,
    };
    let completed = || RecordState::Completed {
        response: StoredResponse {
            status: 201,
            headers: vec![],
            body: bytes::Bytes::new(),
        },
        completed_at: UnixMillis(5),
    };
    let held = |until: i64| RecordState::InProgress {
        token: FencingToken::generate(),
        locked_until: UnixMillis(until),
    };
    // a replay, or another body's 422
    assert!(first_look_decides(
        &record(fp, 10_001, completed()),
        &fp,
        now
    ));
    assert!(first_look_decides(
        &record(other, 10_001, completed()),
        &fp,
        now
    ));
    // past retention: the key is new again, for the script
    assert!(!first_look_decides(
        &record(fp, 10_000, completed()),
        &fp,
        now
    ));
    // a live lease: 409 (or 422 for another body)
    assert!(first_look_decides(
        &record(fp, 20_000, held(10_001)),
        &fp,
        now
    ));
    assert!(first_look_decides(
        &record(other, 20_000, held(10_001)),
        &fp,
        now
    ));
    // a lapsed lease of this request: a takeover, for the script
    assert!(!first_look_decides(
        &record(fp, 20_000, held(10_000)),
        &fp,
        now
    ));
    // a lapsed lease of another body: 422, no takeover
    assert!(first_look_decides(
        &record(other, 20_000, held(10_000)),
        &fp,
        now
    ));
    // a live lease past retention still holds the key
    assert!(first_look_decides(
        &record(fp, 9_000, held(10_001)),
        &fp,
        now
    ));
    // a lapsed lease past retention: new again, for the script
    assert!(!first_look_decides(
        &record(other, 9_000, held(10_000)),
        &fp,
        now
    ));
}

#[test]
fn redis_time_is_milliseconds() {
    let reply = Value::Array(vec![
        Value::BulkString(b"1700000000".to_vec()),
        Value::BulkString(b"123456".to_vec()),
    ]);
    assert_eq!(
        crate::decode::redis_time(&reply).unwrap(),
        UnixMillis(1_700_000_000_123)
    );
    assert!(crate::decode::redis_time(&Value::Nil).is_err());
}

#[tokio::test]
async fn a_records_key_is_spelled_as_before() {
    // Records written by earlier versions must be found again: the key is
    // the prefix, then the hex SHA-256 of the scope's length (8 bytes,
    // big-endian), the scope and the key, in one hash tag.
    let store = store().await;
    let prefix = store.prefix().to_owned();
    assert_eq!(
        store.record_key("s", "k"),
        format!("{prefix}:{{7f50ccf79ef391b6b0e7c23546b3292f08a5afd3dde9d881fa23188a91b08ddd}}")
    );
    assert_eq!(
        store.record_key("tenant-ü", "order-42"),
        format!("{prefix}:{{efb16b3e64f3fe0ebb9b03cba9fcaab7e92a5ab33d2df6c1a1f0a2de86242c98}}")
    );
}

/// A script the server has never seen runs all the same: `EVALSHA` is
/// refused (`NOSCRIPT`), the source is sent (`EVAL`), the script runs once
/// with the same key and arguments and is kept for the next `EVALSHA`.
/// Then the store's own scripts, flushed from the server (as a restart, or
/// a failover to a replica without them, would): a completion and a
/// release after a flush both land. One test, so that no other test of
/// this binary flushes the scripts while the first part counts them.
#[tokio::test]
async fn scripts_the_server_does_not_know_run_once() {
    let store = store().await;
    let mut conn = store.conn.clone();

    let key = store.record_key("s", "script-once");
    // Unknown to the server: its source names this run.
    let source = format!(
        "-- {}\nreturn {{redis.call('INCR', KEYS[1]), ARGV[1], ARGV[2]}}",
        uuid::Uuid::new_v4()
    );
    let script = Script::new(&source);
    let known = |conn: &mut Conn| {
        let mut conn = conn.clone();
        let hash = script.get_hash().to_owned();
        async move {
            redis::cmd("SCRIPT")
                .arg("EXISTS")
                .arg(hash)
                .query_async::<Vec<i64>>(&mut conn)
                .await
                .unwrap()
        }
    };
    assert_eq!(known(&mut conn).await, [0]);
    let args: [&[u8]; 2] = [b"a", b"\x00\xffb"];
    let first = eval_sha(&mut conn, &script, &source, &key, &args)
        .await
        .unwrap();
    assert_eq!(known(&mut conn).await, [1], "kept by EVAL");
    let second = eval_sha(&mut conn, &script, &source, &key, &args)
        .await
        .unwrap();
    let expect = |n| {
        Value::Array(vec![
            Value::Int(n),
            Value::BulkString(b"a".to_vec()),
            Value::BulkString(b"\x00\xffb".to_vec()),
        ])
    };
    // Once each: the refused `EVALSHA` ran nothing.
    assert_eq!(first, expect(1));
    assert_eq!(second, expect(2));

    let claim_of = |key: &str| ClaimRequest {
        scope: "s".into(),
        key: key.into(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(600),
    };
    let flush = || {
        let mut conn = store.conn.clone();
        async move {
            redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query_async::<()>(&mut conn)
                .await
                .unwrap()
        }
    };
    let ClaimOutcome::Acquired(done) = store.claim(&claim_of("done")).await.unwrap() else {
        panic!("a new key is claimed");
    };
    let ClaimOutcome::Acquired(freed) = store.claim(&claim_of("freed")).await.unwrap() else {
        panic!("a new key is claimed");
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: bytes::Bytes::from_static(b"{\"id\":1}"),
    };
    flush().await;
    store.complete(&done, &response).await.unwrap();
    flush().await;
    store.release(&freed).await.unwrap();

    let record = store.get("s", "done").await.unwrap().expect("the record");
    match record.state {
        RecordState::Completed { response: got, .. } => assert_eq!(got, response),
        other => panic!("completed, not {other:?}"),
    }
    // Released: the key is claimed again at once, under the same
    // operation id.
    match store.claim(&claim_of("freed")).await.unwrap() {
        ClaimOutcome::Acquired(again) => assert_eq!(again.operation_id, freed.operation_id),
        other => panic!("claimed again, not {other:?}"),
    }
    // A completion or release under a stale token is still refused.
    assert!(matches!(
        store.complete(&freed, &response).await,
        Err(StoreError::ClaimLost)
    ));
    assert!(matches!(
        store.release(&done).await,
        Err(StoreError::ClaimLost)
    ));
    store.clear().await.unwrap();
}

/// A claim sent again (its reply lost: redis-rs sends a request again
/// when its connection drops) is counted as replicated only if a replica
/// has it, though the script writes nothing the second time: Redis sets a
/// client's `WAIT` offset after every command, read-only ones too, to the
/// offset of everything written so far, the claim included. Here the
/// replica is paused: the claim sent again is refused, not said
/// acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sent_again_counts_only_replicas_that_have_it() {
    use idem_test_support::redis::OwnServer;
    let primary = OwnServer::start();
    let replica = OwnServer::replica_of(&primary);
    primary.wait_replicas_online(1);
    let waiting = RedisStore::connect(
        RedisConfig::new(primary.url()).wait_replicas(1, Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let req = ClaimRequest {
        scope: "s".into(),
        key: "k".into(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(600),
    };
    let (token, proposed) = (FencingToken::generate(), OperationId::generate());
    // The replica acknowledges the first claim; a busy machine may miss
    // the 300 ms once (the refused claim is released, and made again).
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        match waiting.claim_as(&req, token, proposed).await {
            Ok(ClaimOutcome::Acquired(_)) => break,
            Err(StoreError::Unavailable(_)) if std::time::Instant::now() < deadline => {}
            other => panic!("the replica is up, yet {other:?}"),
        }
    }
    replica.pause();
    let again = waiting.claim_as(&req, token, proposed).await;
    replica.resume();
    match again {
        Err(StoreError::Unavailable(e)) => {
            let refused = e.downcast_ref::<crate::NotReplicated>();
            assert_eq!(
                refused.map(|r| (r.wanted, r.acknowledged)),
                Some((1, 0)),
                "{e}"
            );
        }
        other => panic!("no replica has it now, yet {other:?}"),
    }
}
