//! [`FaultProxy`]: a TCP proxy between a service and a server that injects
//! the faults of a network: latency with jitter, a partition that heals,
//! connections cut.
//!
//! Why in user space: this machine's kernel has no `netem` queueing
//! discipline (`tc qdisc add … netem` answers "Specified qdisc kind is
//! unknown"), so latency cannot come from the kernel. A partition held here
//! behaves as TCP across a partition that heals: nothing passes while it
//! lasts, and what was sent arrives afterwards, in order (TCP retransmits
//! it), unless the endpoint gave up first.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// What the link does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Bytes pass at once.
    None,
    /// Each chunk of bytes waits `base` plus up to `jitter` before it goes
    /// on (in order, each direction).
    Delay {
        /// The least delay.
        base: Duration,
        /// The most added to it, at random.
        jitter: Duration,
    },
    /// Nothing passes, either way, nor do new connections reach the
    /// server; what waits goes on when the fault changes.
    Partition,
}

/// A TCP proxy to one server whose link can be made slow, partitioned or
/// cut; stopped when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    fault: watch::Sender<Fault>,
    upstream: Arc<Mutex<String>>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
    /// Connections accepted so far, and those of them stalled for good.
    accepted: Arc<AtomicU64>,
    stalled: Arc<AtomicU64>,
}

impl FaultProxy {
    /// A proxy on a free port of 127.0.0.1 to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> FaultProxy {
        Self::start_on("127.0.0.1", upstream).await
    }

    /// A proxy on a free port of `ip` (the host's end of a veth pair, say)
    /// to `upstream` (`host:port`).
    pub async fn start_on(ip: &str, upstream: &str) -> FaultProxy {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (fault, watching) = watch::channel(Fault::None);
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let upstream = Arc::new(Mutex::new(upstream.to_owned()));
        let target = upstream.clone();
        let tracked = conns.clone();
        let accepted = Arc::new(AtomicU64::new(0));
        let stalled = Arc::new(AtomicU64::new(0));
        let (counting, stalling) = (accepted.clone(), stalled.clone());
        let accept = tokio::spawn(async move {
            let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let link = Link {
                    fault: watching.clone(),
                    number: counting.fetch_add(1, Ordering::SeqCst),
                    stalled: stalling.clone(),
                };
                let upstream = target.lock().unwrap().clone();
                let task = tokio::spawn(carry(client, upstream, link, seed));
                let mut conns = tracked.lock().unwrap();
                conns.retain(|c| !c.is_finished());
                conns.push(task.abort_handle());
            }
        })
        .abort_handle();
        FaultProxy {
            addr,
            fault,
            upstream,
            conns,
            accept,
            accepted,
            stalled,
        }
    }

    /// Stalls every connection open now, for good, without closing it:
    /// nothing more passes on it either way (as on a TCP stream whose
    /// retransmissions back off long after a partition healed). New
    /// connections pass as before.
    pub fn stall(&self) {
        self.stalled
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// Sends new connections to `upstream` from now on (a virtual address
    /// moved to a promoted replica); open ones stay where they are until
    /// [`cut`](Self::cut).
    pub fn set_upstream(&self, upstream: &str) {
        *self.upstream.lock().unwrap() = upstream.to_owned();
    }

    /// Where the service connects instead of the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Makes the link behave as `fault` from now on.
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// The fault now.
    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }

    /// Cuts every open connection (both sides see it closed); new ones are
    /// accepted as before.
    pub fn cut(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// Waits while the link is partitioned.
async fn passable(link: &mut watch::Receiver<Fault>) -> Fault {
    loop {
        let now = *link.borrow_and_update();
        if now != Fault::Partition {
            return now;
        }
        if link.changed().await.is_err() {
            return Fault::None;
        }
    }
}

/// What one connection goes through: the proxy's fault, and whether it
/// was stalled.
#[derive(Clone)]
struct Link {
    fault: watch::Receiver<Fault>,
    /// This connection's number, in the order accepted.
    number: u64,
    /// Connections numbered below this are stalled.
    stalled: Arc<AtomicU64>,
}

impl Link {
    /// Waits while the link is partitioned (for good once stalled).
    async fn passable(&mut self) -> Fault {
        let fault = passable(&mut self.fault).await;
        if self.number < self.stalled.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        fault
    }
}

/// One connection: connects to the server once the link lets it, then
/// carries bytes both ways under the link's fault.
async fn carry(client: TcpStream, upstream: String, mut link: Link, seed: u64) {
    link.passable().await;
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = pump(cr, sw, link.clone(), seed);
    let down = pump(sr, cw, link.clone(), seed ^ 0xdead_beef);
    // Either side closing ends both: the other sees the connection close,
    // once the link lets that through (a close does not cross a
    // partition either).
    tokio::select! {
        () = up => {}
        () = down => {}
    }
    link.passable().await;
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut link: Link,
    mut seed: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Fault::Delay { base, jitter } = link.passable().await {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let extra = if jitter.is_zero() {
                Duration::ZERO
            } else {
                Duration::from_micros(seed % (jitter.as_micros() as u64).max(1))
            };
            tokio::time::sleep(base + extra).await;
            // A partition that began during the delay holds these bytes too.
            link.passable().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on a free port.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream) -> std::io::Result<()> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        Ok(())
    }

    #[tokio::test]
    async fn delays_holds_and_cuts() {
        let proxy = FaultProxy::start(&echo().await.to_string()).await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut s).await.unwrap();

        // Each way waits at least the base delay.
        proxy.set(Fault::Delay {
            base: Duration::from_millis(100),
            jitter: Duration::from_millis(50),
        });
        let started = std::time::Instant::now();
        round_trip(&mut s).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200));

        // A partition holds the bytes; healing delivers them.
        proxy.set(Fault::Partition);
        s.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        let held = tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut buf)).await;
        assert!(held.is_err(), "nothing passes a partition");
        proxy.set(Fault::None);
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");

        // Cut: the connection ends; a new one works.
        proxy.cut();
        let mut end = [0u8; 1];
        let n = s.read(&mut end).await.unwrap_or(0);
        assert_eq!(n, 0, "the cut connection is closed");
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut again).await.unwrap();
    }

    #[tokio::test]
    async fn a_stalled_connection_stays_silent_and_open_while_new_ones_pass() {
        let proxy = FaultProxy::start(&echo().await.to_string()).await;
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut old).await.unwrap();
        proxy.stall();
        old.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        let held = tokio::time::timeout(Duration::from_millis(300), old.read_exact(&mut buf)).await;
        assert!(
            held.is_err(),
            "nothing passes a stalled connection, nor does it close"
        );
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut new).await.unwrap();
        let still =
            tokio::time::timeout(Duration::from_millis(300), old.read_exact(&mut buf)).await;
        assert!(still.is_err(), "the stalled connection stays stalled");
    }
}
