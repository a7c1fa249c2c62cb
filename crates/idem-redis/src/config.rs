//! [`RedisConfig`]: how to reach Redis.

use std::time::Duration;

/// How to reach Redis: one server, or a Redis Cluster.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub(crate) url: String,
    pub(crate) cluster: Option<Vec<String>>,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) wait_replicas: Option<WaitReplicas>,
}

/// How many replicas must have a claim (and a completion) before it counts;
/// see [`RedisConfig::wait_replicas`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitReplicas {
    /// Replicas that must acknowledge.
    pub replicas: u32,
    /// How long to wait for them.
    pub timeout: Duration,
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
            wait_replicas: None,
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
            wait_replicas: None,
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

    /// Counts a claim only once `replicas` replicas have it (`WAIT replicas
    /// timeout` after the claim script, and after each completion), so that
    /// a failover to one of them keeps every claim whose request ran.
    ///
    /// A claim that fewer replicas acknowledged within `timeout` is released
    /// (best effort) and answered as
    /// [`StoreError::Unavailable`](idem_core::StoreError::Unavailable): the request
    /// does not run (`503`). A completion they did not acknowledge is
    /// reported the same way, though the primary holds it (and replays
    /// it); the same completion sent again stands and waits again. A
    /// failover that loses it leaves the replica's copy of the claim, which
    /// a retry takes over after its lease under the same operation id. `WAIT` holds the connection it runs on,
    /// so keep `timeout` below [`timeout`](Self::timeout). On a Redis
    /// Cluster the script and its `WAIT` go together to the primary of the
    /// key's slot. What remains open: `WAIT` is not a consensus; a replica
    /// that acknowledged and then was not the one promoted, or a failover
    /// with several replicas lost at once, can still lose a claim (the
    /// Redis guide).
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = idem_redis::RedisConfig::new("redis://127.0.0.1:6379")
    ///     .wait_replicas(1, Duration::from_millis(200));
    /// assert_eq!(c.waits_for_replicas().map(|w| w.replicas), Some(1));
    /// ```
    pub fn wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_replicas = (replicas > 0).then_some(WaitReplicas { replicas, timeout });
        self
    }

    /// The replicas a claim waits for, if any.
    pub fn waits_for_replicas(&self) -> Option<WaitReplicas> {
        self.wait_replicas
    }

    /// The longest wait for one command or connection attempt. In tiered
    /// mode this bounds what an unreachable Redis adds to a request.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}
