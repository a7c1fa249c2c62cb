//! A record is one value; records an earlier idem wrote as hashes are read,
//! completed, released and taken over as before, and become one value when
//! they change; a layout this version does not know is refused. Against the
//! real server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Claim, ClaimOutcome, FencingToken, OperationId, RecordState, Store, StoreError, StoredResponse,
    UnixMillis,
};
use idem_redis::{RedisConfig, RedisStore};

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn req(key: &str, body: &str, lease: Duration) -> idem_core::ClaimRequest {
    idem_store_suite::request("s", key, body, lease, Duration::from_secs(3600))
}

async fn setup() -> (RedisStore, redis::aio::MultiplexedConnection) {
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect(RedisConfig::new(redis_url()).prefix(prefix))
        .await
        .unwrap_or_else(|e| panic!("cannot reach Redis (`bash scripts/test` starts it): {e}"));
    let raw = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    (store, raw)
}

async fn key_type(raw: &mut redis::aio::MultiplexedConnection, key: &str) -> String {
    redis::cmd("TYPE").arg(key).query_async(raw).await.unwrap()
}

fn now_ms() -> i64 {
    UnixMillis::now().0
}

/// Writes a record the way idem wrote them before one value: a hash.
async fn write_hash(
    raw: &mut redis::aio::MultiplexedConnection,
    key: &str,
    fields: &[(&str, Vec<u8>)],
) {
    let mut cmd = redis::cmd("HSET");
    cmd.arg(key);
    for (f, v) in fields {
        cmd.arg(*f).arg(v.as_slice());
    }
    let _: i64 = cmd.query_async(raw).await.unwrap();
    let _: i64 = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(3_600_000)
        .query_async(raw)
        .await
        .unwrap();
}

fn text(v: impl ToString) -> Vec<u8> {
    v.to_string().into_bytes()
}

#[tokio::test]
async fn a_record_is_one_string_value() {
    let (store, mut raw) = setup().await;
    let lease = Duration::from_secs(60);
    let ClaimOutcome::Acquired(claim) = store.claim(&req("one", "{}", lease)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    let key = store.record_key("s", "one");
    assert_eq!(key_type(&mut raw, &key).await, "string");
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: Bytes::from_static(b"{\"id\":1}"),
    };
    store.complete(&claim, &response).await.unwrap();
    assert_eq!(key_type(&mut raw, &key).await, "string");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl > 3_500_000, "the completion keeps the retention: {ttl}");
    match store.claim(&req("one", "{}", lease)).await.unwrap() {
        ClaimOutcome::Existing(r) => match r.state {
            RecordState::Completed { response: got, .. } => assert_eq!(got, response),
            other => panic!("{other:?}"),
        },
        other => panic!("a replay: {other:?}"),
    }
    store.clear().await.unwrap();
}

#[tokio::test]
async fn records_written_as_hashes_are_read_and_become_one_value_when_they_change() {
    let (store, mut raw) = setup().await;
    let lease = Duration::from_secs(60);
    let now = now_ms();
    let response = StoredResponse {
        status: 201,
        headers: vec![("x-a".into(), b"1".to_vec())],
        body: Bytes::from_static(b"{\"id\":7}"),
    };
    let fp = idem_store_suite::request("s", "k", "{}", lease, lease).fingerprint;
    let op = OperationId::generate();

    // a completed hash: replayed by the first look, left as it is
    let done = store.record_key("s", "done");
    write_hash(
        &mut raw,
        &done,
        &[
            ("s", text("s")),
            ("k", text("done")),
            ("fp", fp.as_bytes().to_vec()),
            ("op", text(op.0)),
            ("tok", text(5)),
            ("st", text("c")),
            ("ca", text(now)),
            ("ea", text(now + 3_600_000)),
            ("co", text(now)),
            ("sc", text(201)),
            ("hd", response.encode_headers()),
            ("bd", response.body.to_vec()),
        ],
    )
    .await;
    match store.claim(&req("done", "{}", lease)).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.operation_id, op);
            match r.state {
                RecordState::Completed { response: got, .. } => assert_eq!(got, response),
                other => panic!("{other:?}"),
            }
        }
        other => panic!("a replay of the hash: {other:?}"),
    }
    let (peeked, _) = store.peek("s", "done").await.unwrap();
    assert!(peeked.is_some());

    // an in-progress hash under a live lease: a duplicate is told so, and
    // its holder (an earlier idem's claim) completes it as one value
    let held = store.record_key("s", "held");
    let token = FencingToken(41);
    let hash_in_progress = |key: &str, lu: i64| {
        vec![
            ("s", text("s")),
            ("k", text(key)),
            ("fp", fp.as_bytes().to_vec()),
            ("op", text(op.0)),
            ("tok", text(token.0)),
            ("st", text("p")),
            ("lu", text(lu)),
            ("ca", text(now)),
            ("ea", text(now + 3_600_000)),
        ]
    };
    write_hash(&mut raw, &held, &hash_in_progress("held", now + 60_000)).await;
    match store.claim(&req("held", "{}", lease)).await.unwrap() {
        ClaimOutcome::Existing(r) => assert!(matches!(
            r.state,
            RecordState::InProgress { token: t, .. } if t == token
        )),
        other => panic!("a live claim of the hash: {other:?}"),
    }
    let holder = Claim {
        scope: "s".into(),
        key: "held".into(),
        token,
        operation_id: op,
        locked_until: UnixMillis(now + 60_000),
        takeover: false,
    };
    let stranger = Claim {
        token: FencingToken(42),
        ..holder.clone()
    };
    assert!(matches!(
        store.complete(&stranger, &response).await,
        Err(StoreError::ClaimLost)
    ));
    assert_eq!(key_type(&mut raw, &held).await, "hash", "nothing written");
    store.complete(&holder, &response).await.unwrap();
    assert_eq!(key_type(&mut raw, &held).await, "string");
    match store.claim(&req("held", "{}", lease)).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(r.operation_id, op);
            assert!(matches!(r.state, RecordState::Completed { .. }));
        }
        other => panic!("a replay: {other:?}"),
    }

    // a released hash is taken over under the same operation id
    let freed = store.record_key("s", "freed");
    write_hash(&mut raw, &freed, &hash_in_progress("freed", now + 60_000)).await;
    store
        .release(&Claim {
            key: "freed".into(),
            ..holder.clone()
        })
        .await
        .unwrap();
    match store.claim(&req("freed", "{}", lease)).await.unwrap() {
        ClaimOutcome::Acquired(c) => {
            assert!(c.takeover);
            assert_eq!(c.operation_id, op);
        }
        other => panic!("a takeover of the released hash: {other:?}"),
    }
    assert_eq!(key_type(&mut raw, &freed).await, "string");
    store.clear().await.unwrap();
}

#[tokio::test]
async fn a_layout_this_version_does_not_know_is_refused_not_guessed() {
    let (store, mut raw) = setup().await;
    let key = store.record_key("s", "newer");
    // layout 3, as a newer idem might write it
    let value: Vec<u8> = vec![0x92, 0x03, 0xa1, b'x'];
    let () = redis::cmd("SET")
        .arg(&key)
        .arg(value.as_slice())
        .arg("PX")
        .arg(60_000)
        .query_async(&mut raw)
        .await
        .unwrap();
    let lease = Duration::from_secs(60);
    match store.claim(&req("newer", "{}", lease)).await {
        Err(StoreError::Corrupt(m)) => assert!(m.contains("layout 3"), "{m}"),
        other => panic!("refused: {other:?}"),
    }
    // the scripts refuse it too, and leave it alone
    let claim = Claim {
        scope: "s".into(),
        key: "newer".into(),
        token: FencingToken(1),
        operation_id: OperationId::generate(),
        locked_until: UnixMillis(now_ms() + 60_000),
        takeover: false,
    };
    assert!(store.release(&claim).await.is_err());
    let still: Vec<u8> = redis::cmd("GET")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(still, value);
    store.clear().await.unwrap();
}
