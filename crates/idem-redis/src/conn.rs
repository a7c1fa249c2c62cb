//! The connection: one server or a cluster, and the key scans that visit
//! every primary.

use std::sync::{Arc, Mutex, PoisonError};

use idem_core::StoreError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};

use crate::store_error;
use redis::cluster_async::ClusterConnection;
use redis::{RedisResult, Value};

/// A connection to one server (reconnecting by itself) or to a cluster
/// (routing each command by its key's slot, following redirections).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(Single),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A connection to one server: a connection manager, which reconnects by
/// itself when the connection drops, and which is replaced by a fresh one
/// when a command times out.
///
/// A time-out does not drop a connection, yet it means its TCP stream is
/// suspect: behind a partition that heals, the kernel's retransmission
/// back-off keeps a stream silent for seconds more (every command queued
/// behind the first times out in turn), and what was queued on it may
/// still run when it wakes. A fresh connection is tried at once instead;
/// the old one closes when the last command on it ends.
#[derive(Clone)]
pub(crate) struct Single {
    shared: Arc<SingleShared>,
    /// The connection this handle sends on, and its generation.
    generation: u64,
    manager: ConnectionManager,
}

struct SingleShared {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// The connection to use now, and its generation (bumped by each
    /// replacement, so that the many commands a stalled connection times
    /// out replace it once).
    current: Mutex<(u64, ConnectionManager)>,
}

impl Single {
    /// Connects to `client`'s server (failing if it cannot be reached now).
    pub(crate) async fn connect(
        client: redis::Client,
        config: ConnectionManagerConfig,
    ) -> RedisResult<Self> {
        let manager = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        Ok(Single {
            shared: Arc::new(SingleShared {
                client,
                config,
                current: Mutex::new((0, manager.clone())),
            }),
            generation: 0,
            manager,
        })
    }

    /// A handle on the connection to use now.
    fn fresh(&self) -> Single {
        let (generation, manager) = self
            .shared
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Single {
            shared: self.shared.clone(),
            generation,
            manager,
        }
    }

    /// After a command on generation `generation` timed out: replaces that
    /// connection with one that connects on its next command (unless
    /// another command replaced it already).
    fn replace(&self, generation: u64) {
        let mut current = self
            .shared
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if current.0 != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(
            self.shared.client.clone(),
            self.shared.config.clone(),
        ) {
            Ok(manager) => {
                tracing::debug!(generation, "a Redis command timed out: reconnecting");
                *current = (generation + 1, manager);
            }
            // Only a configuration the first connection accepted could be
            // refused: keep the connection there is.
            Err(e) => tracing::warn!(error = %e, "could not replace a Redis connection"),
        }
    }

    /// What `result` of a command on `generation` says about it.
    fn after<T>(&self, generation: u64, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &result {
            if e.is_timeout() {
                self.replace(generation);
            }
        }
        result
    }
}

impl ConnectionLike for Single {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        Box::pin(async move {
            *self = self.fresh();
            let result = self.manager.req_packed_command(cmd).await;
            self.after(self.generation, result)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            *self = self.fresh();
            let result = self
                .manager
                .req_packed_commands(pipeline, offset, count)
                .await;
            self.after(self.generation, result)
        })
    }

    fn get_db(&self) -> i64 {
        self.manager.get_db()
    }
}

/// The URL of a cluster node at `addr` (`host:port`), with the seed's
/// scheme, credentials and options.
pub(crate) fn node_url(seed: &str, addr: &str) -> String {
    let (scheme, rest) = seed.split_once("://").unwrap_or(("redis", seed));
    let (userinfo, hostpart) = match rest.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), rest),
    };
    let tail = hostpart.find(['/', '?']).map_or("", |i| &hostpart[i..]);
    format!("{scheme}://{userinfo}{addr}{tail}")
}

/// `s` with the characters SCAN's MATCH treats as a pattern escaped, so a
/// prefix holding `*`, `?`, `[` or `\\` matches only itself.
pub(crate) fn glob_escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Counts (and with `delete`, deletes) the keys under `prefix` on one server.
pub(crate) async fn scan(conn: &mut Conn, prefix: &str, delete: bool) -> Result<u64, StoreError> {
    // A record's key exactly (see `RedisStore::record_key`): `prefix:*`
    // would also match the keys of a prefix that starts with this one and
    // a colon (`shop` and `shop:eu`).
    let pattern = format!("{}:{{{}}}", glob_escaped(prefix), "[0-9a-f]".repeat(64));
    let mut cursor: u64 = 0;
    let mut total = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500)
            .query_async(conn)
            .await
            .map_err(store_error)?;
        if delete && !keys.is_empty() {
            // One DEL per key: on a cluster node, a DEL of several keys
            // fails unless they share a slot.
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.cmd("DEL").arg(key);
            }
            let deleted: Vec<u64> = pipe.query_async(conn).await.map_err(store_error)?;
            total += deleted.iter().sum::<u64>();
        } else if !delete {
            total += keys.len() as u64;
        }
        if next == 0 {
            return Ok(total);
        }
        cursor = next;
    }
}
