//! The claim's first look is plain commands: a replay and a duplicate of a
//! live claim are answered, and a key that holds nothing is claimed,
//! without a script. Proven against the real server by a Redis user that may
//! not run scripts at all (an ACL without `EVAL`, `EVALSHA` and `SCRIPT`):
//! what it answers, it answered with plain commands; what needs the script
//! (a completion, a takeover), it cannot do.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use idem_core::{ClaimOutcome, RecordState, Store, StoreError, StoredResponse};
use idem_redis::{RedisConfig, RedisStore};

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn req(key: &str, body: &str, lease: Duration) -> idem_core::ClaimRequest {
    idem_store_suite::request("s", key, body, lease, Duration::from_secs(3600))
}

/// A Redis user allowed every command but scripts (and whatever more
/// `denied` names), removed by `remove`.
struct NoScripts {
    admin: redis::aio::MultiplexedConnection,
    name: String,
    password: String,
}

impl NoScripts {
    async fn create() -> Self {
        Self::denied(&[]).await
    }

    async fn denied(more: &[&str]) -> Self {
        let client = redis::Client::open(redis_url()).unwrap();
        let mut admin = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("cannot reach Redis (`bash scripts/test` starts it): {e}"));
        let name = format!("idem-noscripts-{}", uuid::Uuid::new_v4().simple());
        let password = uuid::Uuid::new_v4().simple().to_string();
        let () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(&name)
            .arg("on")
            .arg(format!(">{password}"))
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .arg("-@scripting")
            .arg(more)
            .query_async(&mut admin)
            .await
            .unwrap();
        Self {
            admin,
            name,
            password,
        }
    }

    /// The server URL, logged in as this user.
    fn url(&self) -> String {
        let url = redis_url();
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
        format!("redis://{}:{}@{rest}", self.name, self.password)
    }

    async fn remove(mut self) {
        let _: i64 = redis::cmd("ACL")
            .arg("DELUSER")
            .arg(&self.name)
            .query_async(&mut self.admin)
            .await
            .unwrap();
    }
}

/// Two stores on one fresh prefix: one with every right, one as `user`.
async fn stores(user: &NoScripts) -> (RedisStore, RedisStore) {
    let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
    let full = RedisStore::connect(RedisConfig::new(redis_url()).prefix(prefix.clone()))
        .await
        .unwrap_or_else(|e| panic!("cannot reach Redis (`bash scripts/test` starts it): {e}"));
    let limited = RedisStore::connect(RedisConfig::new(user.url()).prefix(prefix))
        .await
        .unwrap();
    (full, limited)
}

#[tokio::test]
async fn replays_and_live_duplicates_are_answered_without_a_script() {
    let user = NoScripts::create().await;
    let (full, plain) = stores(&user).await;
    let lease = Duration::from_secs(60);

    // A completed record: the replay (and another body's 422) come from the
    // first look.
    let ClaimOutcome::Acquired(claim) = full.claim(&req("done", "{}", lease)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: Bytes::from_static(b"{\"id\":1}"),
    };
    full.complete(&claim, &response).await.unwrap();
    for body in ["{}", "{\"other\":1}"] {
        match plain.claim(&req("done", body, lease)).await {
            Ok(ClaimOutcome::Existing(record)) => match record.state {
                RecordState::Completed { response: r, .. } => assert_eq!(r, response),
                other => panic!("the completed record, not {other:?}"),
            },
            other => panic!("a replay without a script: {other:?}"),
        }
    }

    // A claim under a live lease: the duplicate's 409 comes from the first look.
    let ClaimOutcome::Acquired(held) = full.claim(&req("held", "{}", lease)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    match plain.claim(&req("held", "{}", lease)).await {
        Ok(ClaimOutcome::Existing(record)) => assert!(
            matches!(record.state, RecordState::InProgress { token, .. } if token == held.token),
            "{record:?}"
        ),
        other => panic!("a live duplicate without a script: {other:?}"),
    }

    // A key that holds nothing is claimed by the first look's plain
    // `SET … NX`, with no script; every reader, scripts included, counts
    // its times on Redis's clock from the key's expiry, to the millisecond.
    let ClaimOutcome::Acquired(new) = plain.claim(&req("new", "{}", lease)).await.unwrap() else {
        panic!("a new key is claimed without a script");
    };
    assert!(!new.takeover);
    let (Some(seen), now) = full.peek("s", "new").await.unwrap() else {
        panic!("the claim is stored");
    };
    match seen.state {
        RecordState::InProgress {
            token,
            locked_until,
        } => {
            assert_eq!(token, new.token);
            assert_eq!(locked_until, new.locked_until);
            let left = locked_until.0 - now.0;
            assert!(left > 0 && left <= 60_000, "{left} ms of lease left");
        }
        other => panic!("a claim in progress, not {other:?}"),
    }
    assert_eq!(seen.operation_id, new.operation_id);
    // A duplicate meets it at the first look; completing it takes the
    // script, which reads the claim by its key's expiry too.
    match plain.claim(&req("new", "{}", lease)).await {
        Ok(ClaimOutcome::Existing(r)) => assert!(matches!(r.state, RecordState::InProgress { .. })),
        other => panic!("a live duplicate: {other:?}"),
    }
    match plain.complete(&new, &response).await {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("no permissions"), "{e}"),
        other => panic!("completing needs the script: {other:?}"),
    }
    full.complete(&new, &response).await.unwrap();
    match plain.claim(&req("new", "{}", lease)).await {
        Ok(ClaimOutcome::Existing(r)) => {
            assert!(matches!(r.state, RecordState::Completed { .. }), "{r:?}");
            assert_eq!(r.operation_id, new.operation_id);
            // The script read the claim's times as the store did, and
            // wrote them down as they were.
            assert_eq!(r.created_at, seen.created_at);
            assert_eq!(r.expires_at, seen.expires_at);
            assert_eq!(seen.expires_at.0 - seen.created_at.0, 3_600_000);
        }
        other => panic!("the replay: {other:?}"),
    }

    // What only the script decides fails for a user who cannot run one, so
    // the answers above did not come from it: a lapsed lease of the same
    // request (a takeover).
    let short = Duration::from_millis(1);
    let ClaimOutcome::Acquired(_) = full.claim(&req("lapsed", "{}", short)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    match plain.claim(&req("lapsed", "{}", lease)).await {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("no permissions"), "{e}"),
        other => panic!("a takeover needs the claim script: {other:?}"),
    }
    // The lapsed lease taken over through the script, by a user who may.
    match full.claim(&req("lapsed", "{}", lease)).await.unwrap() {
        ClaimOutcome::Acquired(c) => assert!(c.takeover),
        other => panic!("a takeover: {other:?}"),
    }

    full.clear().await.unwrap();
    user.remove().await;
}

/// A `SET` Redis refuses (here a user who may not write; in production
/// memory full under `noeviction`, or too few replicas) costs the first
/// look its claim, not its read: replays are still answered, and a key
/// that needs a claim fails with Redis's refusal.
#[tokio::test]
async fn a_refused_set_leaves_the_plain_read() {
    let user = NoScripts::denied(&["-@write"]).await;
    let (full, reader) = stores(&user).await;
    let lease = Duration::from_secs(60);
    let ClaimOutcome::Acquired(claim) = full.claim(&req("done", "{}", lease)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"{}"),
    };
    full.complete(&claim, &response).await.unwrap();
    match reader.claim(&req("done", "{}", lease)).await {
        Ok(ClaimOutcome::Existing(record)) => {
            assert!(matches!(record.state, RecordState::Completed { .. }));
        }
        other => panic!("a replay by the plain read: {other:?}"),
    }
    match reader.claim(&req("fresh", "{}", lease)).await {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("no permissions"), "{e}"),
        other => panic!("a new key needs a write: {other:?}"),
    }
    let (nothing, _) = full.peek("s", "fresh").await.unwrap();
    assert!(nothing.is_none(), "{nothing:?}");
    full.clear().await.unwrap();
    user.remove().await;
}
