//! [`RedisConfig`]: how to reach Redis.

use std::time::Duration;

/// How to reach Redis: one server, or a Redis Cluster.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub(crate) url: String,
    pub(crate) cluster: Option<Vec<String>>,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
}

impl RedisConfig {
    /// Redis at `url` (`redis://host:port/db`), keys under `idem`, and a
    /// 500 ms bound on each command and connection attempt.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            cluster: None,
            prefix: "idem".to_owned(),
            timeout: Duration::from_millis(500),
        }
    }

    /// A Redis Cluster, found from one or more of its nodes
    /// (`redis://host:port` each). A record's keys share one hash slot (see
    /// [Keys](crate#keys)), so each operation is still one script on one
    /// node.
    ///
    /// ```
    /// let c = idem_redis::RedisConfig::cluster(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]);
    /// assert!(c.is_cluster());
    /// ```
    pub fn cluster<I, S>(nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(Into::into).collect();
        Self {
            url: nodes.first().cloned().unwrap_or_default(),
            cluster: Some(nodes),
            prefix: "idem".to_owned(),
            timeout: Duration::from_millis(500),
        }
    }

    /// Whether this names a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// The prefix of every key (default `idem`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest wait for one command or connection attempt. In tiered
    /// mode this bounds what an unreachable Redis adds to a request.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}
