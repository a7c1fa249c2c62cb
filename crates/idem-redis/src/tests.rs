//! Unit tests of the store's pieces that need no server.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::conn::glob_escaped;

#[test]
fn patterns_in_a_prefix_match_only_themselves() {
    assert_eq!(glob_escaped("idem"), "idem");
    assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
}

/// Against the Redis the tests use (`bash scripts/test` starts it).
#[tokio::test]
async fn a_claim_sent_twice_is_won_twice_not_a_conflict_with_itself() {
    let url = std::env::var("IDEM_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let store = RedisStore::connect(
        RedisConfig::new(url).prefix(format!("idem-unit-{}", uuid::Uuid::new_v4().simple())),
    )
    .await
    .expect("Redis is up");
    let key = store.record_key("s", "k");
    let token = FencingToken::generate();
    let claim_once = || {
        let mut conn = store.conn.clone();
        let mut inv = store.claim.key(&key);
        inv.arg("s")
            .arg("k")
            .arg(b"fp".as_slice())
            .arg(OperationId::generate().0.to_string())
            .arg(token.0)
            .arg(30_000)
            .arg(600_000);
        async move { inv.invoke_async::<Vec<Value>>(&mut conn).await.unwrap() }
    };
    let first = claim_once().await;
    let again = claim_once().await;
    assert_eq!(bytes_of(&first[0]), Some(&b"won"[..]));
    assert_eq!(bytes_of(&again[0]), Some(&b"won"[..]), "{again:?}");
    assert_eq!(first[1], again[1], "the same operation id");
    store.clear().await.unwrap();
}
