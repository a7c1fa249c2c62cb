//! The gRPC listener's limits, the HTTP server's own (`idem_axum::serve`):
//! at most `max_connections` connections at once (more are closed at once,
//! not queued), a connection that has not sent HTTP/2's connection preface
//! (its first 24 bytes) within `header_timeout` is closed, a request body
//! that stalls longer than `body_timeout` between two chunks fails its call,
//! and a shutdown waits at most `grace` (in `main`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;

/// An accepted connection holding one of the listener's slots until it
/// closes.
#[derive(Debug)]
pub(crate) struct Slot {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    /// Until the peer's connection preface has arrived: when it must have
    /// sent it.
    first_bytes: Option<Pin<Box<tokio::time::Sleep>>>,
    /// How many bytes the peer has sent, counted up to the preface's length.
    heard: usize,
}

/// The length of HTTP/2's connection preface (`PRI * HTTP/2.0…`), which a
/// client sends before anything else. h2 waits for all of it without a
/// time limit of its own, and the keep-alive pings only start once it has
/// come, so a peer that sends one byte of it and then nothing would hold a
/// slot for ever: the header timeout runs until the whole preface is in.
const PREFACE_LEN: usize = 24;

/// The connections `listener` accepts, at most `max` open at once: one
/// beyond is closed as soon as it is accepted, so stalled sockets cannot
/// queue the rest behind them.
pub(crate) fn capped(
    listener: TcpListener,
    max: usize,
    first_bytes_within: Duration,
) -> impl Stream<Item = io::Result<Slot>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS)));
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |accepted| {
        match accepted {
            Ok(stream) => match slots.clone().try_acquire_owned() {
                Ok(slot) => Some(Ok(Slot {
                    stream,
                    _slot: slot,
                    first_bytes: Some(Box::pin(tokio::time::sleep(first_bytes_within))),
                    heard: 0,
                })),
                Err(_) => {
                    tracing::debug!("gRPC connection over the limit: closed");
                    None
                }
            },
            // Out of file descriptors and the like: that connection is
            // lost, the listener goes on.
            Err(e) => {
                tracing::warn!(error = %e, "gRPC accept failed");
                None
            }
        }
    })
}

impl Connected for Slot {
    type ConnectInfo = <TcpStream as Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Slot {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Some(deadline) = this.first_bytes.as_mut() {
            if let Poll::Ready(Ok(())) = &read {
                this.heard = this
                    .heard
                    .saturating_add(buf.filled().len().saturating_sub(before));
            }
            if this.heard >= PREFACE_LEN {
                this.first_bytes = None;
            } else if deadline.as_mut().poll(cx).is_ready() {
                // A connection that never speaks (or stops inside its
                // preface) holds a slot for nothing: closed, as HTTP's
                // header timeout does.
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not send its connection preface within the header timeout",
                )));
            }
        }
        read
    }
}

impl AsyncWrite for Slot {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
