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

/// A `redis-server` of one test's own on a free port, for what the shared
/// one must not be put through (a replica to pause); killed, and its
/// directory removed, when dropped.
#[derive(Debug)]
pub struct OwnServer {
    child: std::process::Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl OwnServer {
    /// A server of its own, answering once this returns.
    ///
    /// # Panics
    ///
    /// If `redis-server` cannot be run or does not answer within 10 s.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A replica of `primary`, answering once this returns (see
    /// [`OwnServer::wait_replicas_online`] for when it has caught up).
    pub fn replica_of(primary: &OwnServer) -> Self {
        Self::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()])
    }

    fn start_with(args: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir =
            std::env::temp_dir().join(format!("idem-redis-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory of its own");
        let spawned = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .args(args)
            .stdout(std::process::Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                panic!("cannot run redis-server (`bash scripts/test` installs it): {e}");
            }
        };
        let mut server = Self { child, port, dir };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        // Its own: the server that answers on the port is this process
        // (another could have taken the port between its pick and the start).
        let pid = format!("process_id:{}\r\n", server.child.id());
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("redis-server on {port} exited: {status}");
            }
            let info = server.query::<String>(redis::cmd("INFO").arg("server"));
            if info.is_ok_and(|i| i.contains(&pid)) {
                return server;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server on {port} never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn query<T: redis::FromRedisValue>(&self, cmd: &mut redis::Cmd) -> redis::RedisResult<T> {
        let mut conn =
            redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        cmd.query(&mut conn)
    }

    /// Waits (up to 30 s) until `n` replicas acknowledge a write: a write
    /// and `WAIT` on one connection, since `WAIT` counts that connection's
    /// writes.
    ///
    /// # Panics
    ///
    /// If they never do.
    pub fn wait_replicas_online(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let acked = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
                .and_then(|mut conn| {
                    redis::pipe()
                        .cmd("SET")
                        .arg("idem-test-ack-probe")
                        .arg(1)
                        .ignore()
                        .cmd("WAIT")
                        .arg(n)
                        .arg(500)
                        .query::<(usize,)>(&mut conn)
                });
            if acked.is_ok_and(|(acked,)| acked >= n) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{n} replicas never acknowledged a write on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the process (SIGSTOP): connected, it acknowledges nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Continues a [`OwnServer::pause`]d process.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let sent = std::process::Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill {signal} redis-server");
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
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
