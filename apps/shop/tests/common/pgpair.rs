//! [`PgPair`]: a PostgreSQL primary and a streaming standby of the test's
//! own (two clusters under /tmp on free ports, run as the `postgres` user),
//! the standby's replication link through a [`FaultProxy`] so that a test
//! can hold the standby back before it fails the primary over.

use std::path::{Path, PathBuf};
use std::process::Command;

use idem_test_support::faults::FaultProxy;

/// How the primary waits for its standby before it acknowledges a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names` names the standby and
    /// `synchronous_commit = on`: a commit is acknowledged once the standby
    /// has flushed it.
    Synchronous,
    /// No synchronous standby: a commit is acknowledged once the primary
    /// has flushed it; the standby follows when it can.
    Asynchronous,
}

/// A primary and its standby, stopped and removed when dropped.
pub struct PgPair {
    dir: PathBuf,
    bin: PathBuf,
    pub primary_port: u16,
    pub standby_port: u16,
    /// The standby's replication connection to the primary.
    pub replication: FaultProxy,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `program` with `args` as the `postgres` user; panics with its
/// output when it fails.
fn as_postgres(program: &Path, args: &[&str]) {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(program)
        .args(args)
        .output()
        .expect("runuser");
    assert!(
        out.status.success(),
        "{} {args:?} failed: {}{}",
        program.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The newest PostgreSQL's binaries.
fn bin_dir() -> PathBuf {
    let mut versions: Vec<u32> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed under /usr/lib/postgresql")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    versions.sort_unstable();
    let v = versions.last().expect("a PostgreSQL version");
    PathBuf::from(format!("/usr/lib/postgresql/{v}/bin"))
}

impl PgPair {
    /// Starts a primary, then a standby streaming from it (through the
    /// `replication` proxy), with `replication`'s setting.
    pub async fn start(mode: Replication) -> PgPair {
        let bin = bin_dir();
        let dir = PathBuf::from(format!(
            "/tmp/idem-pgpair-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let chown = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success());
        let primary_port = free_port();
        let standby_port = free_port();
        let replication = FaultProxy::start(&format!("127.0.0.1:{primary_port}")).await;
        // From here on, the guard stops what started if a step fails.
        let pair = PgPair {
            dir: dir.clone(),
            bin: bin.clone(),
            primary_port,
            standby_port,
            replication,
        };
        let primary = dir.join("primary");
        let standby = dir.join("standby");
        let p = primary.to_str().unwrap();
        let s = standby.to_str().unwrap();
        as_postgres(
            &bin.join("initdb"),
            &[
                "-D",
                p,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        let sync = match mode {
            Replication::Synchronous => "synchronous_standby_names = 'standby1'\n",
            Replication::Asynchronous => "synchronous_standby_names = ''\n",
        };
        let conf = format!(
            "port = {primary_port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             wal_level = replica\nmax_wal_senders = 5\nmax_connections = 100\nshared_buffers = 32MB\n\
             synchronous_commit = on\n{sync}",
            dir.display()
        );
        append(&primary.join("postgresql.conf"), &conf);
        as_postgres(
            &bin.join("pg_ctl"),
            &["-D", p, "-l", &format!("{p}.log"), "-w", "start"],
        );
        let via = pair.replication.addr();
        as_postgres(
            &bin.join("pg_basebackup"),
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary_port.to_string(),
                "-U",
                "postgres",
                "-D",
                s,
                "-X",
                "stream",
                "-R",
            ],
        );
        append(
            &standby.join("postgresql.auto.conf"),
            &format!(
                "primary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name=standby1'\nport = {standby_port}\n\
                 # Promoted, it has no standby of its own to wait for.\nsynchronous_standby_names = ''\n",
                via.port()
            ),
        );
        as_postgres(
            &bin.join("pg_ctl"),
            &["-D", s, "-l", &format!("{s}.log"), "-w", "start"],
        );
        pair.wait_streaming(mode).await;
        pair
    }

    /// Waits until the standby streams (and, synchronous, is the sync one).
    async fn wait_streaming(&self, mode: Replication) {
        let pool = sqlx::PgPool::connect(&self.primary_url()).await.unwrap();
        let want = match mode {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1' AND state = 'streaming'",
            )
            .fetch_optional(&pool)
            .await
            .unwrap();
            if state.as_deref() == Some(want) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the standby never streamed ({state:?})"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        pool.close().await;
    }

    pub fn primary_url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.primary_port
        )
    }

    pub fn standby_url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.standby_port
        )
    }

    /// The primary dies at once (`pg_ctl stop -m immediate`: no shutdown
    /// checkpoint, as a crash).
    pub fn crash_primary(&self) {
        let p = self.dir.join("primary");
        as_postgres(
            &self.bin.join("pg_ctl"),
            &["-D", p.to_str().unwrap(), "-m", "immediate", "stop"],
        );
    }

    /// The standby becomes the primary.
    pub fn promote_standby(&self) {
        let s = self.dir.join("standby");
        as_postgres(
            &self.bin.join("pg_ctl"),
            &["-D", s.to_str().unwrap(), "-w", "promote"],
        );
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

impl Drop for PgPair {
    fn drop(&mut self) {
        for node in ["primary", "standby"] {
            let d = self.dir.join(node);
            let _ = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(self.bin.join("pg_ctl"))
                .args([
                    "-D",
                    d.to_str().unwrap_or_default(),
                    "-m",
                    "immediate",
                    "stop",
                ])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
