//! Slow and stalled clients against the real `shop`: they are cut off by
//! the server's limits, never hold it open, never starve other clients.
//! And instances starting beside each other: the schema step blocks no one
//! and upgrades an older database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{read, Db, Shop};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn addr(shop: &Shop) -> String {
    shop.base.trim_start_matches("http://").to_owned()
}

/// Reads until the server closes the connection (or answers), within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // An answer (408 or the like) before the close is fine too.
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

/// Waits until one of `sockets` is closed (the one over a connection
/// limit, closed at once), then says how many of the others are open.
async fn open_once_one_closed(sockets: &mut [TcpStream]) -> usize {
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            for (i, s) in sockets.iter_mut().enumerate() {
                if closed_within(s, Duration::from_millis(50)).await {
                    return i;
                }
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "a connection over the limit is closed");
    let mut open = 0;
    for (i, s) in sockets.iter_mut().enumerate() {
        if Ok(i) != closed && !closed_within(s, Duration::from_millis(50)).await {
            open += 1;
        }
    }
    open
}

/// SIGTERM, then the process must exit by itself, successfully (started
/// with a grace of 1 s; the rest of the wait is margin for a loaded
/// machine).
fn terminated_within_grace(shop: &mut Shop) {
    shop.terminate();
    let status = shop.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stalls_in_its_headers_is_disconnected() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--header-timeout-secs", "1"]).await;
    let mut stream = TcpStream::connect(addr(&shop)).await.unwrap();
    stream
        .write_all(b"POST /payments HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n")
        .await
        .unwrap();
    // The timeout is 1 s; the margin is the test's patience, not the server's speed.
    assert!(
        closed_within(&mut stream, Duration::from_secs(20)).await,
        "the half-sent request was never cut off"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_fails_its_request_and_frees_the_handler() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--body-timeout-secs", "1"]).await;
    let mut stream = TcpStream::connect(addr(&shop)).await.unwrap();
    stream
        .write_all(
            b"POST /payments HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n\
              Content-Type: application/json\r\nIdempotency-Key: k-stall\r\n\
              Content-Length: 100\r\n\r\n{\"account_id\"",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the stalled upload held its request open");
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 4"),
        "a client error or a closed connection, never a 5xx: {text}"
    );
    // The key was not left claimed: the same request, whole, runs.
    let client = reqwest::Client::new();
    let retry = common::read(common::pay(&client, &shop, Some("k-stall"), common::BODY)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_stalled_sockets_do_not_stop_healthz() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--header-timeout-secs", "30"]).await;
    let mut stalled = Vec::new();
    for _ in 0..1000 {
        let mut s = TcpStream::connect(addr(&shop)).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
        stalled.push(s);
    }
    let client = reqwest::Client::new();
    let started = Instant::now();
    let health = client
        .get(shop.url("/healthz"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("healthz answers beside 1000 stalled sockets");
    assert_eq!(health.status(), 200);
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_connection_limit_new_connections_are_closed_not_queued() {
    let db = Db::sqlite();
    let shop = Shop::start(
        &db,
        &["--max-connections", "5", "--header-timeout-secs", "30"],
    )
    .await;
    // Six clients, each stalled in its headers (the header time-out, 30 s,
    // is far off): whatever order the server accepts them in, one over the
    // limit of five is closed at once (not queued), and never more than
    // five stay open. (More than one may close: the harness's readiness
    // probe can still hold a slot for a moment.) No sleep guesses when the
    // server has accepted them.
    let mut stalled = Vec::new();
    for _ in 0..6 {
        let mut s = TcpStream::connect(addr(&shop)).await.unwrap();
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHo").await;
        stalled.push(s);
    }
    let open = open_once_one_closed(&mut stalled).await;
    assert!(open <= 5, "{open} connections served beyond the limit of 5");
    // Once the stalled ones go, the service is whole again.
    drop(stalled);
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = client.get(shop.url("/healthz")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the slots were never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_never_keeps_the_process_alive_past_the_grace_period() {
    let db = Db::sqlite();
    let mut shop = Shop::start(
        &db,
        &["--shutdown-grace-secs", "1", "--body-timeout-secs", "600"],
    )
    .await;
    let mut stream = TcpStream::connect(addr(&shop)).await.unwrap();
    stream
        .write_all(
            b"POST /payments HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n\
              Content-Type: application/json\r\nIdempotency-Key: k-grace\r\n\
              Content-Length: 100\r\n\r\n{",
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    terminated_within_grace(&mut shop);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_continue_with_a_body_too_large_is_413_without_100_continue() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    for path in ["/payments", "/orders"] {
        let mut stream = TcpStream::connect(addr(&shop)).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n\
             Content-Type: application/json\r\nIdempotency-Key: k-expect\r\n\
             Expect: 100-continue\r\nContent-Length: 50000000\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut first = vec![0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut first))
            .await
            .expect("an answer without sending the body")
            .unwrap();
        let text = String::from_utf8_lossy(&first[..n]);
        assert!(text.starts_with("HTTP/1.1 413"), "{path}: {text}");
        assert!(!text.contains("100 Continue"), "{path}: {text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("application/problem+json"),
            "{path}: {text}"
        );
    }
}

/// Too many header fields, or too many bytes of them, is a 431 problem
/// that reaches no handler; what stays within the limits is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_a_431_problem() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();

    let mut many = client.get(shop.url("/healthz"));
    for i in 0..150 {
        many = many.header(format!("x-filler-{i}"), "1");
    }
    let mut large = client.get(shop.url("/healthz"));
    large = large.header("x-filler", "a".repeat(20 * 1024));
    for request in [many, large] {
        let a = read(request).await;
        assert_eq!(a.status, 431, "{a:?}");
        assert_eq!(a.headers["content-type"], "application/problem+json");
        assert_eq!(a.json()["status"], 431);
    }
    // A payment's headers past the limit charge nothing.
    let mut pay = common::pay(&client, &shop, Some("k-431"), common::BODY);
    for i in 0..150 {
        pay = pay.header(format!("x-filler-{i}"), "1");
    }
    assert_eq!(read(pay).await.status, 431);
    assert_eq!(
        common::account(&client, &shop, "acc_1").await["bank_charges"],
        0
    );

    let mut fine = client.get(shop.url("/healthz"));
    for i in 0..80 {
        fine = fine.header(format!("x-filler-{i}"), "1");
    }
    assert_eq!(read(fine).await.status, 200);
}

/// The most connections a `shop` on PostgreSQL (URL tagged with its own
/// `application_name`) opens while 40 clients read at once, 5 times over.
async fn most_connections_under_reads(extra: &[&str]) -> (i64, u64) {
    let db = Db::postgres().await;
    let tag = format!("shop-pool-{}", uuid::Uuid::new_v4().simple());
    let url = format!("{}&application_name={tag}", db.url());
    let url = if url.contains('?') {
        url
    } else {
        url.replacen('&', "?", 1)
    };
    let shop = Shop::start_url(&url, extra).await;
    let client = common::signed_in();
    let admin = sqlx::PgPool::connect(&db.url()).await.unwrap();
    let most = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let watching = {
        let (admin, most, tag) = (admin.clone(), most.clone(), tag.clone());
        tokio::spawn(async move {
            loop {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(&tag)
                .fetch_one(&admin)
                .await
                .unwrap();
                most.fetch_max(n, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let mut ok = 0;
    for _ in 0..5 {
        let mut reads = tokio::task::JoinSet::new();
        for i in 0..40 {
            let req = client.get(shop.url(&format!("/accounts/acc_{i}")));
            reads.spawn(async move { req.send().await.map(|r| r.status().as_u16()) });
        }
        while let Some(answer) = reads.join_next().await {
            if answer.unwrap().is_ok_and(|s| s == 200) {
                ok += 1;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    watching.abort();
    admin.close().await;
    (most.load(std::sync::atomic::Ordering::SeqCst), ok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn db_connections_bounds_the_pool() {
    // The pool of 6, one for /healthz, one the fake bank opened at start,
    // one the outbox relay listens on.
    let (most, ok) = most_connections_under_reads(&["--db-connections", "6"]).await;
    assert_eq!(ok, 200, "every read answered");
    assert!(most <= 6 + 3, "at most 6 + 3 connections, saw {most}");
    // The same load without the flag opens more: the bound is the flag's.
    let (unbounded, _) = most_connections_under_reads(&[]).await;
    eprintln!("connections: {most} with --db-connections 6, {unbounded} without");
    assert!(
        unbounded > most,
        "{unbounded} without the flag, {most} with it"
    );
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--database-url", "sqlite::memory:", "--db-connections", "4"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("in-memory"));
    let db = Db::postgres().await;
    let too_few = std::process::Command::new(env!("CARGO_BIN_EXE_shop"))
        .args(["--database-url", &db.url(), "--db-connections", "4"])
        .output()
        .unwrap();
    assert!(!too_few.status.success());
    assert!(String::from_utf8_lossy(&too_few.stderr).contains("at least 5"));
}

/// The gRPC listener's address (`host:port`).
fn grpc_addr(shop: &Shop) -> String {
    shop.grpc
        .as_deref()
        .expect("started with --grpc-listen")
        .trim_start_matches("http://")
        .to_owned()
}

/// One HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Header fields as HPACK literals (not indexed, names and values short).
fn hpack(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0);
        out.push(u8::try_from(name.len()).unwrap());
        out.extend_from_slice(name.as_bytes());
        out.push(u8::try_from(value.len()).unwrap());
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// Opens an HTTP/2 connection to `addr`: the preface and empty SETTINGS
/// sent, then the server's first SETTINGS read (not yet acknowledged);
/// gives the connection and that frame's parameters (identifier, value).
async fn h2_connect(addr: &str) -> (TcpStream, Vec<(u16, u32)>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&h2_frame(4, 0, 0, &[])).await.unwrap();
    loop {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).await.unwrap();
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await.unwrap();
        if head[3] == 4 && head[4] & 1 == 0 {
            let settings = payload
                .chunks_exact(6)
                .map(|p| {
                    (
                        u16::from_be_bytes([p[0], p[1]]),
                        u32::from_be_bytes([p[2], p[3], p[4], p[5]]),
                    )
                })
                .collect();
            return (s, settings);
        }
    }
}

/// Opens an HTTP/2 connection to `addr` and starts a `CreatePayment` call
/// whose message never finishes: its frame says 100 bytes, one is sent.
async fn stalled_grpc_call(addr: &str) -> TcpStream {
    let (mut s, _) = h2_connect(addr).await;
    // The server's SETTINGS, acknowledged.
    s.write_all(&h2_frame(4, 1, 0, &[])).await.unwrap();
    let headers = hpack(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/shop.v1.Payments/CreatePayment"),
        (":authority", "shop"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("authorization", "Bearer a"),
        ("idempotency-key", "k-grpc-stalled"),
    ]);
    s.write_all(&h2_frame(1, 4, 1, &headers)).await.unwrap();
    s.write_all(&h2_frame(0, 0, 1, &[0, 0, 0, 0, 100, 0x0a]))
        .await
        .unwrap();
    s
}

/// Reads until the call on stream 1 ends: an error status in a HEADERS
/// frame, a reset of the stream, a GOAWAY, or the connection closed
/// (rather than waiting for the rest of its message).
async fn grpc_call_ended(from: &mut (impl AsyncReadExt + Unpin)) {
    loop {
        let mut head = [0u8; 9];
        if from.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        if from.read_exact(&mut payload).await.is_err() {
            return;
        }
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if (stream == 1 && matches!(head[3], 1 | 3)) || head[3] == 7 {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_grpc_call_never_keeps_the_process_alive_past_the_grace_period() {
    let db = Db::sqlite();
    let mut shop = Shop::start(
        &db,
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--shutdown-grace-secs",
            "1",
            "--body-timeout-secs",
            "600",
        ],
    )
    .await;
    let _stalled = stalled_grpc_call(&grpc_addr(&shop)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    terminated_within_grace(&mut shop);
}

/// A stalled upload and a stalled gRPC call at once: the process exits
/// within one grace of SIGTERM, not one grace per server (the HTTP
/// server's drain, then the gRPC server's, then the handlers' each waited
/// a grace of their own before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_calls_on_both_servers_share_one_grace_period() {
    let db = Db::sqlite();
    let grace = Duration::from_secs(3);
    let mut shop = Shop::start(
        &db,
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--shutdown-grace-secs",
            "3",
            "--body-timeout-secs",
            "600",
        ],
    )
    .await;
    let _grpc = stalled_grpc_call(&grpc_addr(&shop)).await;
    let mut http = TcpStream::connect(addr(&shop)).await.unwrap();
    http.write_all(
        b"POST /payments HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n\
          Content-Type: application/json\r\nIdempotency-Key: k-both\r\n\
          Content-Length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Timed from before the signal is sent: the exit can only seem later.
    let signalled = Instant::now();
    shop.terminate();
    let status = shop.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    // One grace (3 s), with half a grace's margin for a loaded machine:
    // two graces in a row (6 s) are well past it.
    let took = signalled.elapsed();
    assert!(took < grace + grace / 2, "exited {took:?} after SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_grpc_body_fails_its_call_within_the_body_timeout() {
    let db = Db::sqlite();
    let shop = Shop::start(
        &db,
        &["--grpc-listen", "127.0.0.1:0", "--body-timeout-secs", "1"],
    )
    .await;
    let mut stalled = stalled_grpc_call(&grpc_addr(&shop)).await;
    // 1 s, with the rest as margin.
    let ended = tokio::time::timeout(Duration::from_secs(20), grpc_call_ended(&mut stalled)).await;
    assert!(ended.is_ok(), "the stalled call was still open after 20 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_connection_limit_new_grpc_connections_are_closed() {
    let db = Db::sqlite();
    let shop = Shop::start(
        &db,
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--max-connections",
            "5",
            "--header-timeout-secs",
            "30",
        ],
    )
    .await;
    // Six silent connections: one over the limit of five is closed at
    // once, whatever order they are accepted in; five stay open.
    let mut sockets = Vec::new();
    for _ in 0..6 {
        sockets.push(TcpStream::connect(grpc_addr(&shop)).await.unwrap());
    }
    let open = open_once_one_closed(&mut sockets).await;
    assert_eq!(open, 5, "five gRPC connections within the limit stay open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_answers_the_newest_thousand_oldest_first() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &[]).await;
    let client = reqwest::Client::new();
    let paid = read(common::pay(&client, &shop, Some("k-list"), common::BODY)).await;
    assert_eq!(paid.status, 201);
    let id = paid.json()["id"].as_str().unwrap().to_owned();
    // 1,005 events processed for it (written straight into the table: the
    // webhook's own path is tested elsewhere).
    let pool = sqlx::SqlitePool::connect(&db.url()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    for n in 1..=1005_i64 {
        sqlx::query(
            "INSERT INTO shop_bank_events (event_id, type, payment_id, received_at) VALUES ($1, 'charge.settled', $2, $3)",
        )
        .bind(format!("evt_{n:05}"))
        .bind(&id)
        .bind(n)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    pool.close().await;
    let events = read(
        client
            .get(shop.url(&format!("/payments/{id}/events")))
            .header("authorization", "Bearer client-1"),
    )
    .await;
    assert_eq!(events.status, 200);
    let events = events.json()["events"].as_array().unwrap().clone();
    assert_eq!(events.len(), 1000);
    assert_eq!(events[0]["event_id"], "evt_00006");
    assert_eq!(events[999]["event_id"], "evt_01005");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_connection_that_says_nothing_is_closed_after_the_header_timeout() {
    let db = Db::sqlite();
    let shop = Shop::start(
        &db,
        &["--grpc-listen", "127.0.0.1:0", "--header-timeout-secs", "1"],
    )
    .await;
    let mut silent = TcpStream::connect(grpc_addr(&shop)).await.unwrap();
    // One that sends the first bytes of HTTP/2's preface and then nothing:
    // h2 would wait for the rest for ever, and pings start only after it.
    let mut halting = TcpStream::connect(grpc_addr(&shop)).await.unwrap();
    halting.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    // 1 s, with the rest as margin for a loaded machine.
    assert!(
        closed_within(&mut silent, Duration::from_secs(20)).await,
        "a silent gRPC connection was kept open"
    );
    assert!(
        closed_within(&mut halting, Duration::from_secs(20)).await,
        "a gRPC connection stopped inside its preface was kept open"
    );
    // One that speaks is served.
    let _stalled = stalled_grpc_call(&grpc_addr(&shop)).await;
}

/// Writes one byte every 300 ms (never idle for the 2 s body timeout, but
/// 3 bytes a second against a minimum of 100) until the server ends the
/// request; says whether it did within 20 s (`--body-timeout-secs 2`, so
/// about 2 s, the rest margin for a loaded machine).
async fn trickle_until_cut(
    write: &mut (impl AsyncWriteExt + Unpin),
    byte: impl Fn() -> Vec<u8>,
    ended: impl std::future::Future<Output = ()>,
) -> bool {
    let trickle = async {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if write.write_all(&byte()).await.is_err() {
                // The server closed the connection.
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), async {
        tokio::select! {
            () = ended => {}
            () = trickle => {}
        }
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_trickled_below_the_minimum_rate_is_cut_off_and_its_key_left_free() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--body-timeout-secs", "2", "--body-min-rate", "100"]).await;
    let stream = TcpStream::connect(addr(&shop)).await.unwrap();
    let (mut read_half, mut write_half) = stream.into_split();
    write_half
        .write_all(
            b"POST /payments HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n\
              Content-Type: application/json\r\nIdempotency-Key: k-trickle\r\n\
              Content-Length: 1000\r\n\r\n{",
        )
        .await
        .unwrap();
    let answer = std::sync::Mutex::new(Vec::new());
    let ended = async {
        let mut buf = [0u8; 1024];
        while let Ok(n @ 1..) = read_half.read(&mut buf).await {
            answer.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    };
    let cut = trickle_until_cut(&mut write_half, || b" ".to_vec(), ended).await;
    // 1,000 bytes at 3 a second would take over five minutes.
    assert!(cut, "the trickled upload was still open after 20 s");
    let answer = answer.into_inner().unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 4"),
        "a client error or a closed connection, never a 5xx: {text}"
    );
    let client = reqwest::Client::new();
    let retry = common::read(common::pay(&client, &shop, Some("k-trickle"), common::BODY)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_within_its_grace_is_served() {
    let db = Db::sqlite();
    // Any real rate fails a body that takes 1 s; the grace (the body
    // timeout, 10 s) comes first.
    let shop = Shop::start(&db, &["--body-min-rate", "1000000000"]).await;
    let mut stream = TcpStream::connect(addr(&shop)).await.unwrap();
    let body = common::BODY.as_bytes();
    let (first, rest) = body.split_at(body.len() / 2);
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer a\r\n\
         Content-Type: application/json\r\nIdempotency-Key: k-slow\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(first).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stream.write_all(rest).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_message_trickled_below_the_minimum_rate_fails_its_call() {
    let db = Db::sqlite();
    let shop = Shop::start(
        &db,
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--body-timeout-secs",
            "2",
            "--body-min-rate",
            "100",
        ],
    )
    .await;
    let stream = stalled_grpc_call(&grpc_addr(&shop)).await;
    let (mut read_half, mut write_half) = stream.into_split();
    // One more byte of the 100-byte message in each DATA frame.
    let cut = trickle_until_cut(
        &mut write_half,
        || h2_frame(0, 0, 1, b" "),
        grpc_call_ended(&mut read_half),
    )
    .await;
    assert!(cut, "the trickled call was still open after 20 s");
}

/// An instance starting beside a running one on PostgreSQL takes no lock
/// on the tables in use: it starts while a transaction holds a row of
/// `bank_charges` (a payment at the bank), and reads of that table are
/// never queued behind its schema step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_starts_beside_open_transactions_on_postgres() {
    let db = Db::postgres().await;
    let first = Shop::start(&db, &[]).await;
    let pool = sqlx::PgPool::connect(&db.url()).await.unwrap();
    let second = starts_beside_a_writer_of_bank_charges(&db, &pool).await;
    drop((first, second));
    pool.close().await;
}

/// Starts another instance on `db` while a transaction holds a row of
/// `bank_charges` and writes to it (ROW EXCLUSIVE): a schema step that
/// took SHARE or ACCESS EXCLUSIVE on the table would wait for it (then
/// give up, after its 10 s lock wait). The instance, once it answers.
async fn starts_beside_a_writer_of_bank_charges(db: &Db, pool: &sqlx::PgPool) -> Shop {
    let mut open = pool.begin().await.unwrap();
    for sql in [
        "SELECT 1 FROM bank_charges FOR UPDATE",
        "LOCK TABLE bank_charges IN ROW EXCLUSIVE MODE",
    ] {
        sqlx::query(sql).execute(&mut *open).await.unwrap();
    }
    let started = Shop::start(db, &[]).await;
    let client = reqwest::Client::new();
    let health = read(client.get(started.url("/healthz"))).await;
    assert_eq!(health.status, 200);
    open.rollback().await.unwrap();
    started
}

/// An upgrade from the release whose checkouts kept their key but not
/// what they pay with adds `shop_checkouts.intent` alone, on PostgreSQL
/// without a lock on the tables that had every column: it starts while a
/// transaction writes to `bank_charges`. Before, every added column's
/// `ADD COLUMN IF NOT EXISTS`, and every index's `CREATE INDEX IF NOT
/// EXISTS`, ran and waited for that transaction (and gave up after the
/// 10 s lock wait, so the instance did not start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_that_adds_one_column_locks_only_its_table_on_postgres() {
    let db = Db::postgres().await;
    let first = Shop::start(&db, &[]).await;
    db.execute("ALTER TABLE shop_checkouts DROP COLUMN intent")
        .await;
    let pool = sqlx::PgPool::connect(&db.url()).await.unwrap();
    let second = starts_beside_a_writer_of_bank_charges(&db, &pool).await;
    let added: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = 'shop_checkouts'
           AND column_name = 'intent'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(added, 1);
    drop((first, second));
    pool.close().await;
}

/// A payment whose statement waits on a lock past `--statement-timeout-ms`
/// is answered `503`, and on PostgreSQL the statement is cancelled by the
/// server too (the transaction's own `statement_timeout`): nothing of shop's
/// still waits on the lock, holding a connection and a place in the lock's
/// queue, once the client has its answer. Before, it waited on until the
/// lock was let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_cut_by_its_timeout_stops_waiting_on_postgres() {
    let db = Db::postgres().await;
    let Db::Postgres(schema) = &db else {
        unreachable!()
    };
    let shop = Shop::start(&db, &["--statement-timeout-ms", "500"]).await;
    let pool = sqlx::PgPool::connect(&db.url()).await.unwrap();
    let mut open = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE shop_payments IN EXCLUSIVE MODE")
        .execute(&mut *open)
        .await
        .unwrap();
    let client = common::signed_in();
    let paid = read(
        client
            .post(shop.url("/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k-locked")
            .body(common::BODY),
    )
    .await;
    assert_eq!(paid.status, 503, "{paid:?}");
    let waiting = format!(
        "SELECT count(*) FROM pg_locks WHERE relation = '\"{}\".shop_payments'::regclass AND NOT granted",
        schema.name()
    );
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar(&waiting).fetch_one(&pool).await.unwrap();
        if n == 0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "a statement shop gave up on still waits on the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    open.rollback().await.unwrap();
    pool.close().await;
}

on_both_backends!(an_older_database_is_upgraded_by_two_instances_starting_at_once);

/// A database made before charges named their merchant and carried a
/// reference, before checkouts kept their key and what they pay with, and
/// before emails were indexed by payment: two instances starting at once
/// add the columns and the index (one of them; neither fails on the
/// other's), and a payment and a checkout then work.
async fn an_older_database_is_upgraded_by_two_instances_starting_at_once(db: Db) {
    drop(Shop::start(&db, &[]).await);
    let older: &[&str] = match db {
        // (SQLite's DROP COLUMN trips over the comments in the table's
        // text: the empty tables are made again as they were.)
        Db::Sqlite(..) => &[
            "DROP TABLE bank_charges",
            "CREATE TABLE bank_charges (id TEXT PRIMARY KEY, operation_id TEXT NOT NULL UNIQUE,
                 account_id TEXT NOT NULL, amount BIGINT NOT NULL, currency TEXT NOT NULL,
                 created_at BIGINT NOT NULL)",
            "DROP TABLE shop_checkouts",
            "CREATE TABLE shop_checkouts (order_id TEXT PRIMARY KEY, client_id TEXT NOT NULL,
                 operation_id TEXT NOT NULL, created_at BIGINT NOT NULL)",
            "DROP INDEX shop_emails_payment",
        ],
        Db::Mysql(_) => &[
            "ALTER TABLE bank_charges DROP INDEX bank_charges_reference, DROP COLUMN reference",
            "ALTER TABLE shop_checkouts DROP COLUMN idempotency_key, DROP COLUMN intent",
            "ALTER TABLE shop_emails DROP INDEX shop_emails_payment",
        ],
        Db::Postgres(_) | Db::PostgresAt(_) => &[
            "ALTER TABLE bank_charges DROP COLUMN reference, DROP COLUMN client_id",
            "ALTER TABLE shop_checkouts DROP COLUMN idempotency_key, DROP COLUMN intent",
            "DROP INDEX shop_emails_payment",
        ],
    };
    // Each fails where the index is missing.
    let indexed = match db {
        Db::Sqlite(..) => {
            "SELECT id FROM shop_emails INDEXED BY shop_emails_payment WHERE payment_id = 'p'"
        }
        Db::Mysql(_) => {
            "SELECT id FROM shop_emails FORCE INDEX (shop_emails_payment) WHERE payment_id = 'p'"
        }
        Db::Postgres(_) | Db::PostgresAt(_) => "SELECT 'shop_emails_payment'::regclass",
    };
    for sql in older {
        db.execute(sql).await;
    }
    let (first, second) = tokio::join!(Shop::start(&db, &[]), Shop::start(&db, &[]));
    let client = reqwest::Client::new();
    for shop in [&first, &second] {
        assert_eq!(read(client.get(shop.url("/healthz"))).await.status, 200);
    }
    db.execute(indexed).await;
    let paid = read(common::pay(
        &client,
        &first,
        Some("upgraded-pay"),
        common::BODY,
    ))
    .await;
    assert_eq!(paid.status, 201, "{paid:?}");
    let placed = read(
        client
            .post(second.url("/orders"))
            .header("authorization", "Bearer client-1")
            .header("content-type", "application/json")
            .body(r#"{"customer_id":"cust-1","client_reference":"upgraded","items":[{"sku":"sku-1","qty":1}]}"#),
    )
    .await;
    assert_eq!(placed.status, 201, "{placed:?}");
    let order = placed.json()["id"].as_str().unwrap().to_owned();
    let checkout = || {
        client
            .post(second.url(&format!("/orders/{order}/checkout")))
            .header("authorization", "Bearer client-1")
            .header("content-type", "application/json")
            .header("idempotency-key", "upgraded-checkout")
            .body(r#"{"account_id":"acc_up","amount":1000,"currency":"EUR"}"#)
    };
    let paid = read(checkout()).await;
    assert_eq!(paid.status, 200, "{paid:?}");
    assert_eq!(paid.json()["status"], "paid", "{paid:?}");
    let again = read(checkout()).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert!(again.replayed, "{again:?}");
}

/// One gRPC connection cannot open calls without end (each would hold a
/// database connection): the server says its cap in its first SETTINGS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_connection_is_told_how_many_calls_it_may_open_at_once() {
    let db = Db::sqlite();
    let shop = Shop::start(&db, &["--grpc-listen", "127.0.0.1:0"]).await;
    let (_connection, settings) =
        tokio::time::timeout(Duration::from_secs(20), h2_connect(&grpc_addr(&shop)))
            .await
            .expect("the server's SETTINGS within 20 s");
    // SETTINGS_MAX_CONCURRENT_STREAMS
    let cap = settings.iter().find(|(id, _)| *id == 3).map(|(_, v)| *v);
    assert_eq!(cap, Some(100), "{settings:?}");
}
