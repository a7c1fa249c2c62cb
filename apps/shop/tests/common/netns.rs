//! [`Netns`]: a network namespace of the test's own, joined to the host by
//! two veth pairs: one that `shop` reaches its servers through (taken down
//! for a partition the kernel makes: packets dropped, TCP retransmitting,
//! then delivered when it comes back up, or losing a share of its packets
//! at random, by nftables), one its clients reach it by.

use std::process::Command;

/// Runs `ip` with `args`; panics with its output when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2; `bash scripts/test` installs it)");
    assert!(
        out.status.success(),
        "ip {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A namespace and its two links; deleted when dropped.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
    /// The host's end of the servers' link: fault proxies listen here.
    pub servers_host_ip: String,
    /// The namespace's address on the clients' link: `shop` listens here.
    pub clients_ns_ip: String,
    servers_host_if: String,
    servers_ns_if: String,
}

impl Netns {
    pub fn create() -> Netns {
        let id = uuid::Uuid::new_v4().as_u128();
        let tag = format!("{:06x}", id & 0xff_ffff);
        let name = format!("idem-{tag}");
        // Two /30 subnets of 10.0.0.0/8 picked at random, so tests running
        // at once do not meet.
        let a = 1 + (id >> 24) % 250;
        let b = ((id >> 32) % 64) * 4;
        let c = ((id >> 40) % 64) * 4;
        ip(&["netns", "add", &name]);
        // Deleted by this guard if what follows fails.
        let mut guard = Netns {
            name: name.clone(),
            servers_host_ip: String::new(),
            clients_ns_ip: String::new(),
            servers_host_if: String::new(),
            servers_ns_if: String::new(),
        };
        let ns = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        ns(&["link", "set", "lo", "up"]);
        let pair = |host_if: &str, ns_if: &str, subnet: u128| {
            ip(&[
                "link", "add", host_if, "type", "veth", "peer", "name", ns_if,
            ]);
            ip(&["link", "set", ns_if, "netns", &name]);
            let host_ip = format!("10.{a}.{subnet}.{}", 1);
            let ns_ip = format!("10.{a}.{subnet}.{}", 2);
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", host_if]);
            ip(&["link", "set", host_if, "up"]);
            ns(&["addr", "add", &format!("{ns_ip}/30"), "dev", ns_if]);
            ns(&["link", "set", ns_if, "up"]);
            (host_ip, ns_ip)
        };
        let servers_host_if = format!("is{tag}");
        let servers_ns_if = format!("js{tag}");
        let (servers_host_ip, _) = pair(&servers_host_if, &servers_ns_if, b);
        let (_, clients_ns_ip) = pair(&format!("ic{tag}"), &format!("jc{tag}"), c + 1);
        guard.servers_host_ip = servers_host_ip;
        guard.clients_ns_ip = clients_ns_ip;
        guard.servers_host_if = servers_host_if;
        guard.servers_ns_if = servers_ns_if;
        guard
    }

    /// Runs `nft` in the namespace; panics with its output when it fails.
    fn nft(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.name, "nft"];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// Drops `percent` of the packets on the servers' link, each way, at
    /// random: TCP retransmits what is lost, so a statement's round trip
    /// takes from one to many retransmission time-outs.
    pub fn lose(&self, percent: u8) {
        let share = percent.to_string();
        self.nft(&["add", "table", "inet", "idem_loss"]);
        for (chain, hook, dir) in [("in", "input", "iifname"), ("out", "output", "oifname")] {
            let spec = format!("{{ type filter hook {hook} priority 0 ; }}");
            self.nft(&["add", "chain", "inet", "idem_loss", chain, &spec]);
            self.nft(&[
                "add",
                "rule",
                "inet",
                "idem_loss",
                chain,
                dir,
                &self.servers_ns_if,
                "numgen",
                "random",
                "mod",
                "100",
                "<",
                &share,
                "drop",
            ]);
        }
    }

    /// Stops dropping packets.
    pub fn stop_losing(&self) {
        self.nft(&["delete", "table", "inet", "idem_loss"]);
    }

    /// Takes the servers' link down: nothing passes either way.
    pub fn partition(&self) {
        ip(&["link", "set", &self.servers_host_if, "down"]);
    }

    /// Brings it back up.
    pub fn heal(&self) {
        ip(&["link", "set", &self.servers_host_if, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pairs with it.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
