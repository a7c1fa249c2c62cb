//! `serve`'s connection cap counts the guarded handlers whose clients went
//! away: a client that sends a guarded request and hangs up, again and
//! again, cannot start handlers without end. (A binary of its own: the
//! count of running handlers is the process's.)
#![cfg(feature = "serve")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use idem_axum::serve::{serve, Limits};
use idem_axum::IdempotencyLayer;
use idem_core::Policy;
use idem_memory::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use gate::{handler, until, until_idle, Gate};

fn guarded(key: &str) -> String {
    format!(
        "POST /p HTTP/1.1\r\nHost: t\r\nX-Client: a\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    )
}

/// Sends a guarded request on a new connection and hangs up once the
/// handler has started.
async fn send_and_hang_up(addr: SocketAddr, key: &str, gate: &Gate, started_before: usize) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(guarded(key).as_bytes()).await.unwrap();
    gate.until_started_past(started_before).await;
    drop(s);
}

/// Whether the server answers a plain request on a new connection (as
/// opposed to closing it unanswered).
async fn answers(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return false;
    };
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut got)).await;
    got.starts_with(b"HTTP/1.1 200")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_whose_clients_hung_up_count_against_the_connection_cap() {
    let gate = Gate::closed();
    let scope = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-client")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| {
                axum::response::IntoResponse::into_response(http::StatusCode::UNAUTHORIZED)
            })
    };
    let app = Router::new()
        .route("/p", post(handler))
        .layer(IdempotencyLayer::new(
            Arc::new(MemoryStore::new()),
            Policy::default(),
            scope,
        ))
        .route("/health", axum::routing::get(|| async { "ok" }))
        .with_state(gate.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = Limits {
        max_connections: 3,
        ..Limits::default()
    };
    tokio::spawn(serve(listener, app, limits, std::future::pending()));

    assert!(answers(addr).await, "served below the cap");
    // Three clients send a guarded request each and hang up: their handlers
    // run on, waiting at the gate, and no connection is open.
    for n in 0..3 {
        send_and_hang_up(addr, &format!("k{n}"), &gate, n).await;
    }
    assert_eq!(idem_once::detached::running(), 3);
    // The server sees each client gone (the connection closed) in its own
    // time, and drops that request: its handler then counts as abandoned.
    until(
        || idem_once::detached::abandoned() == 3,
        "not every handler counted as abandoned",
    )
    .await;
    // Now a new connection is closed unanswered, however often it is tried.
    for _ in 0..5 {
        assert!(
            !answers(addr).await,
            "a connection served beside 3 handlers"
        );
    }
    assert_eq!(gate.started(), 3, "no handler more");
    // Once the handlers finish, connections are served again.
    gate.open.add_permits(3);
    until_idle().await;
    assert!(answers(addr).await, "served again once the handlers ended");
}
