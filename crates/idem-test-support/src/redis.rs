//! A Redis key prefix of one test's own, its keys deleted after it.

use std::time::Duration;

/// The Redis the tests use (`IDEM_TEST_REDIS_URL`, by default the local one).
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Deletes every key under `prefix:` on the Redis at `url` (best effort:
/// a server that cannot be reached is left as it is). The keys are found
/// by `SCAN`, a thousand slots at a time, so the server answers other
/// clients in between: `KEYS` would hold the shared server for as long as
/// reading its whole keyspace takes (a fifth of a second per million keys
/// here), while the tests running beside this one wait. One `DEL` per key:
/// a cluster node refuses a `DEL` across slots.
pub fn clear_prefix(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else {
        return;
    };
    let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(5)) else {
        return;
    };
    // A server that stops answering is left as it is, not waited on.
    if conn.set_read_timeout(Some(Duration::from_secs(5))).is_err()
        || conn
            .set_write_timeout(Some(Duration::from_secs(5)))
            .is_err()
    {
        return;
    }
    // The pattern is the prefix up to its first character `SCAN` would
    // read as a wildcard; the keys it finds are then kept only if they
    // are under the prefix itself.
    let literal = prefix
        .find(['*', '?', '[', ']', '\\'])
        .map_or(prefix, |at| &prefix[..at]);
    let pattern = format!("{literal}*");
    let under = format!("{prefix}:");
    let mut cursor: u64 = 0;
    loop {
        let found: redis::RedisResult<(u64, Vec<Vec<u8>>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(&mut conn);
        let Ok((next, keys)) = found else {
            return;
        };
        let mut pipe = redis::pipe();
        let mut any = false;
        for key in keys.iter().filter(|k| k.starts_with(under.as_bytes())) {
            pipe.cmd("DEL").arg(key).ignore();
            any = true;
        }
        if any {
            let _: redis::RedisResult<()> = pipe.query(&mut conn);
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

/// A key prefix of one test's own on [`redis_url`]; its keys are deleted
/// when it is dropped.
#[derive(Debug)]
pub struct TestPrefix(String);

impl TestPrefix {
    /// A fresh prefix starting with `test`.
    pub fn new(test: &str) -> Self {
        Self(format!("{test}-{}", uuid::Uuid::new_v4().simple()))
    }

    /// The prefix.
    pub fn name(&self) -> &str {
        &self.0
    }
}

impl Drop for TestPrefix {
    fn drop(&mut self) {
        clear_prefix(&redis_url(), &self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> redis::Connection {
        redis::Client::open(redis_url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(5)))
            .expect("the tests' Redis (bash scripts/test starts it)")
    }

    /// Every key under the prefix goes, over several `SCAN` pages; keys of
    /// a prefix that merely starts the same way, or holds a glob character
    /// the pattern must not read as one, stay.
    #[test]
    fn clears_its_prefix_and_nothing_else() {
        let base = format!("clear-{}", uuid::Uuid::new_v4().simple());
        let mine = format!("{base}[x]");
        let mut conn = conn();
        let mut pipe = redis::pipe();
        for i in 0..2_500 {
            pipe.cmd("SET")
                .arg(format!("{mine}:{i}"))
                .arg(i)
                .arg("EX")
                .arg(600)
                .ignore();
        }
        // `[x]` read as a class would match `x`: this key must stay.
        pipe.cmd("SET")
            .arg(format!("{base}x:1"))
            .arg(1)
            .arg("EX")
            .arg(600)
            .ignore();
        pipe.cmd("SET")
            .arg(format!("{mine}-other:1"))
            .arg(1)
            .arg("EX")
            .arg(600)
            .ignore();
        let () = pipe.query(&mut conn).unwrap();

        clear_prefix(&redis_url(), &mine);

        let mut left = redis::cmd("EXISTS");
        for i in 0..2_500 {
            left.arg(format!("{mine}:{i}"));
        }
        assert_eq!(left.query::<usize>(&mut conn).unwrap(), 0);
        let kept: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(format!("{base}x:1"))
            .arg(format!("{mine}-other:1"))
            .query(&mut conn)
            .unwrap();
        assert_eq!(kept, [Some(1), Some(1)]);
        let () = redis::cmd("DEL")
            .arg(format!("{base}x:1"))
            .arg(format!("{mine}-other:1"))
            .query(&mut conn)
            .unwrap();
    }
}
