//! [`OwnCluster`]: a Redis Cluster of the test's own, three primaries each
//! with a replica, on free ports (and free bus ports, 10000 above), with a
//! one-second node timeout so that a killed primary's replica takes over
//! in a few seconds.

use std::time::{Duration, Instant};

use super::OwnRedis;

/// Six nodes; stopped when dropped.
pub struct OwnCluster {
    pub nodes: Vec<OwnRedis>,
}

/// A port that is free, with its bus port (10000 above) free too.
fn free_pair() -> u16 {
    loop {
        let base = 20_000 + (uuid::Uuid::new_v4().as_u128() % 25_000) as u16;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(base) && free(base + 10_000) {
            return base;
        }
    }
}

impl OwnCluster {
    pub fn start() -> OwnCluster {
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let port = free_pair();
            nodes.push(OwnRedis::start_on(
                port,
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    // A replica that comes back syncs at once (Redis
                    // waits 5 s by default for more replicas to join the
                    // transfer): until it has, every claim that waits for
                    // a replica is refused.
                    "--repl-diskless-sync-delay",
                    "0",
                ]
                .map(str::to_owned)
                .to_vec(),
            ));
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = std::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = OwnCluster { nodes };
        cluster.wait_healthy(3);
        cluster
    }

    /// The URLs of its nodes, comma-separated (`--redis-url` with
    /// `--redis-cluster`).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(OwnRedis::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `CLUSTER NODES` as one of the live nodes sees it.
    fn view(&self, skip: Option<usize>) -> String {
        for (i, n) in self.nodes.iter().enumerate() {
            if Some(i) == skip {
                continue;
            }
            let v = n.cli(&["CLUSTER", "NODES"]);
            if !v.trim().is_empty() {
                return v;
            }
        }
        String::new()
    }

    /// Waits until the cluster is `ok`, with three primaries of which
    /// `with_replica` have a connected replica.
    pub fn wait_healthy(&self, with_replica: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = self
                .nodes
                .iter()
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            let view = self.view(None);
            let primaries: Vec<&str> = view
                .lines()
                .filter(|l| l.contains("master") && !l.contains("fail"))
                .filter_map(|l| l.split(' ').next())
                .collect();
            let replicated = primaries
                .iter()
                .filter(|id| {
                    view.lines().any(|l| {
                        l.contains("slave")
                            && l.contains(*id)
                            && l.contains("connected")
                            && !l.contains("fail")
                    })
                })
                .count();
            if ok && primaries.len() == 3 && replicated >= with_replica {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never became healthy:\n{view}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills a primary (as a crash), waits until its replica took over and
    /// acts as primary, then starts the killed node again, empty: it
    /// rejoins as the new primary's replica. Returns the killed node's
    /// index.
    ///
    /// With `hold_back`, the replica falls behind first: for a second
    /// before the kill, the kernel drops what the primary sends on its
    /// replication link (an nftables rule on that one connection), so what
    /// the primary acknowledged in that second never reaches the replica
    /// it fails over to, as with a replica on a slow link.
    pub fn fail_over_a_primary(&mut self, hold_back: bool) -> usize {
        let view = self.view(None);
        let victim_port = view
            .lines()
            .find(|l| l.contains("master") && !l.contains("fail"))
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|addr| addr.split('@').next())
            .and_then(|addr| addr.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
            .expect("a primary");
        let i = self
            .nodes
            .iter()
            .position(|n| n.port == victim_port)
            .expect("the primary is ours");
        // Its replica, by what the replica itself says (not the cluster's
        // gossip, which names it primary before it acts as one).
        let replica = self
            .nodes
            .iter()
            .position(|n| {
                n.cli(&["ROLE"])
                    .lines()
                    .nth(2)
                    .is_some_and(|port| port.trim() == victim_port.to_string())
            })
            .expect("the primary has a replica");
        let held = hold_back.then(|| {
            let held = HeldBack::start(&self.nodes[i]);
            std::thread::sleep(Duration::from_secs(1));
            held
        });
        self.nodes[i].stop();
        // Its replica is promoted once the others agree it failed. The
        // killed node comes back only after the replica acts as primary: a
        // primary without persistence that restarts sooner (within the node
        // time-out) comes back empty and still primary, and its replica
        // resynchronises from it, emptying the shard (Redis's own warning
        // on replication without persistence). Measured here first by
        // mistake: every record of the shard lost, `WAIT` or not.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let promoted = self.nodes[replica]
                .cli(&["ROLE"])
                .lines()
                .next()
                .is_some_and(|role| role.trim() == "master");
            let view = self.view(Some(i));
            let primaries = view
                .lines()
                .filter(|l| l.contains("master") && !l.contains("fail"))
                .count();
            let ok = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .all(|(_, n)| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            if ok && primaries == 3 && promoted {
                break;
            }
            assert!(Instant::now() < deadline, "no failover:\n{view}");
            std::thread::sleep(Duration::from_millis(100));
        }
        // The kernel still retransmits what the killed primary had sent
        // (its socket outlives it): held until the replica acts as
        // primary, that never arrives.
        drop(held);
        self.nodes[i].restart();
        self.wait_healthy(3);
        i
    }
}

/// An nftables table of its own that drops what a primary sends its
/// replica on their replication connection (and nothing else); deleted
/// when dropped.
struct HeldBack {
    table: String,
}

impl HeldBack {
    fn start(primary: &OwnRedis) -> HeldBack {
        // The replica's end of the link, as the primary sees it.
        let listing = primary.cli(&["CLIENT", "LIST", "TYPE", "replica"]);
        let replica_port = listing
            .split_whitespace()
            .find_map(|f| f.strip_prefix("addr="))
            .and_then(|addr| addr.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or_else(|| panic!("the primary has no replica connection: {listing}"));
        let table = format!("idem_hold_{}", primary.port);
        let nft = |args: &[&str]| {
            let out = std::process::Command::new("nft")
                .args(args)
                .output()
                .expect("nft (bash scripts/test installs nftables)");
            assert!(
                out.status.success(),
                "nft {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        nft(&["add", "table", "inet", &table]);
        nft(&[
            "add",
            "chain",
            "inet",
            &table,
            "out",
            "{ type filter hook output priority 0 ; }",
        ]);
        nft(&[
            "add",
            "rule",
            "inet",
            &table,
            "out",
            "tcp",
            "sport",
            &primary.port.to_string(),
            "tcp",
            "dport",
            &replica_port.to_string(),
            "drop",
        ]);
        HeldBack { table }
    }
}

impl Drop for HeldBack {
    fn drop(&mut self) {
        let _ = std::process::Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .output();
    }
}
