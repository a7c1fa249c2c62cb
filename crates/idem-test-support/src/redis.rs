//! A Redis key prefix of one test's own, its keys deleted after it.

/// The Redis the tests use (`IDEM_TEST_REDIS_URL`, by default the local one).
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Deletes every key under `prefix:` on the Redis at `url`, one key at a
/// time (a cluster node refuses a `DEL` across slots), with `redis-cli`.
pub fn clear_prefix(url: &str, prefix: &str) {
    let _ = std::process::Command::new("redis-cli")
        .args(["-u", url, "EVAL"])
        .arg("for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end")
        .args(["0", &format!("{prefix}:*")])
        .output();
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
