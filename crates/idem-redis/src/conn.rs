//! The connection: one server or a cluster, and the key scans that visit
//! every primary.

use idem_core::StoreError;
use redis::aio::ConnectionManager;

use crate::store_error;
use redis::cluster_async::ClusterConnection;
use redis::Value;

/// A connection to one server (reconnecting by itself) or to a cluster
/// (routing each command by its key's slot, following redirections).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Conn {
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
    let mut cursor: u64 = 0;
    let mut total = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{}:*", glob_escaped(prefix)))
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
