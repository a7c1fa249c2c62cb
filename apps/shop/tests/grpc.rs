//! shop's gRPC API (`--grpc-listen`, `shop.v1.Payments`) driven by a real
//! tonic client over TCP, in every mode: the same contract as HTTP, the
//! same database and bank.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

#[path = "../src/grpc/pb.rs"]
#[allow(
    missing_docs,
    unreachable_pub,
    dead_code,
    missing_debug_implementations,
    clippy::all
)]
mod pb;

use std::time::{Duration, Instant};

use common::{account, signed_in, start_in, Db, Mode, RedisPrefix, Shop};
use pb::payments_client::PaymentsClient;
use pb::{CreatePaymentRequest, GetPaymentRequest, Payment};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

async fn start(mode: Mode, db: &Db, prefix: &RedisPrefix, extra: &[&str]) -> Shop {
    let mut flags = vec!["--grpc-listen", "127.0.0.1:0"];
    flags.extend_from_slice(extra);
    start_in(mode, db, &prefix.0, &flags).await
}

async fn client(shop: &Shop) -> PaymentsClient<Channel> {
    let channel = Channel::from_shared(shop.grpc.clone().expect("the gRPC address"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    PaymentsClient::new(channel)
}

fn new_payment(account: &str, amount: i64) -> CreatePaymentRequest {
    CreatePaymentRequest {
        account_id: account.to_owned(),
        amount,
        currency: "EUR".to_owned(),
    }
}

/// A request with metadata: `("authorization", "Bearer client-1")`, …
fn with<T>(message: T, metadata: &[(&'static str, &str)]) -> Request<T> {
    let mut request = Request::new(message);
    for (name, value) in metadata {
        request.metadata_mut().insert(*name, value.parse().unwrap());
    }
    request
}

async fn create(
    c: &mut PaymentsClient<Channel>,
    key: Option<&str>,
    message: CreatePaymentRequest,
    extra: &[(&'static str, &str)],
) -> Result<Response<Payment>, Status> {
    let mut metadata = vec![("authorization", "Bearer client-1")];
    if let Some(key) = key {
        metadata.push(("idempotency-key", key));
    }
    metadata.extend_from_slice(extra);
    c.create_payment(with(message, &metadata)).await
}

fn replayed<T>(r: &Response<T>) -> bool {
    r.metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// Calls until an answer that is not "in flight" or "unavailable" (a
/// crashed holder's lease running out, the shop restarting), within `within`.
async fn settle(
    shop: &Shop,
    key: &str,
    message: CreatePaymentRequest,
    within: Duration,
) -> Result<Response<Payment>, Status> {
    let deadline = Instant::now() + within;
    loop {
        let answer = match Channel::from_shared(shop.grpc.clone().unwrap())
            .unwrap()
            .connect()
            .await
        {
            Ok(ch) => {
                create(
                    &mut PaymentsClient::new(ch),
                    Some(key),
                    message.clone(),
                    &[],
                )
                .await
            }
            Err(e) => Err(Status::unavailable(e.to_string())),
        };
        match &answer {
            Err(s)
                if matches!(s.code(), Code::Aborted | Code::Unavailable)
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            _ => return answer,
        }
    }
}

async fn grpc_contract(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("grpc-contract");
    let shop = start(mode, &db, &prefix, &[]).await;
    let mut c = client(&shop).await;

    // who: no tenant is UNAUTHENTICATED
    let anonymous = c
        .create_payment(with(
            new_payment("acc_g", 100),
            &[("idempotency-key", "k0")],
        ))
        .await
        .unwrap_err();
    assert_eq!(anonymous.code(), Code::Unauthenticated, "{anonymous:?}");
    // the key is required
    let keyless = create(&mut c, None, new_payment("acc_g", 100), &[])
        .await
        .unwrap_err();
    assert_eq!(keyless.code(), Code::InvalidArgument, "{keyless:?}");
    assert!(
        keyless.message().contains("idempotency-key"),
        "{}",
        keyless.message()
    );
    // the HTTP bounds, before the claim: corrected under the same key, it runs
    for bad in [
        new_payment("acc_g", 0),
        new_payment("acc g", 100),
        CreatePaymentRequest {
            currency: "EURO".into(),
            ..new_payment("acc_g", 100)
        },
        new_payment("acc_g", 1_000_000_001),
    ] {
        let refused = create(&mut c, Some("k1"), bad.clone(), &[])
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            Code::InvalidArgument,
            "{bad:?}: {refused:?}"
        );
    }
    let unknown = create(
        &mut c,
        Some("k1"),
        new_payment("acc_g", 100),
        &[("x-simulate", "explode")],
    )
    .await
    .unwrap_err();
    assert_eq!(unknown.code(), Code::InvalidArgument);

    let first = create(&mut c, Some("k1"), new_payment("acc_g", 100), &[])
        .await
        .unwrap();
    assert!(!replayed(&first));
    let payment = first.get_ref().clone();
    assert!(payment.id.starts_with("pay_"), "{payment:?}");
    assert_eq!(
        (
            payment.account_id.as_str(),
            payment.amount,
            payment.currency.as_str()
        ),
        ("acc_g", 100, "EUR")
    );
    assert_eq!(payment.status, "authorized");
    assert_eq!(payment.operation_id.len(), 36, "{payment:?}");

    // a repeat is the first answer, marked
    let again = create(&mut c, Some("k1"), new_payment("acc_g", 100), &[])
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), &payment);
    // the key with another message
    let reused = create(&mut c, Some("k1"), new_payment("acc_g", 101), &[])
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");

    // reading it back: the owner sees it, another client does not
    let got = c
        .get_payment(with(
            GetPaymentRequest {
                id: payment.id.clone(),
            },
            &[("authorization", "Bearer client-1")],
        ))
        .await
        .unwrap();
    assert_eq!(got.get_ref(), &payment);
    let hidden = c
        .get_payment(with(
            GetPaymentRequest {
                id: payment.id.clone(),
            },
            &[("authorization", "Bearer client-2")],
        ))
        .await
        .unwrap_err();
    assert_eq!(hidden.code(), Code::NotFound);
    let unauthenticated = c
        .get_payment(Request::new(GetPaymentRequest {
            id: payment.id.clone(),
        }))
        .await
        .unwrap_err();
    assert_eq!(unauthenticated.code(), Code::Unauthenticated);

    // the charge is one, and HTTP sees it
    let http = signed_in();
    let acc = account(&http, &shop, "acc_g").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "{acc}");
    let over_http = http
        .get(shop.url(&format!("/payments/{}", payment.id)))
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    assert_eq!(over_http["amount"], 100, "{over_http}");

    // racing duplicates, the bank slow: one charge, every answer the same
    let racers: Vec<_> = (0..8)
        .map(|_| {
            let mut c = c.clone();
            tokio::spawn(async move {
                create(
                    &mut c,
                    Some("race"),
                    new_payment("acc_race", 7),
                    &[("x-simulate", "bank-delay=300")],
                )
                .await
            })
        })
        .collect();
    let mut paid = Vec::new();
    for r in racers {
        match r.await.unwrap() {
            Ok(p) => paid.push(p),
            Err(s) => assert_eq!(s.code(), Code::Aborted, "{s:?}"),
        }
    }
    let settled = settle(
        &shop,
        "race",
        new_payment("acc_race", 7),
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    assert!(paid.iter().all(|p| p.get_ref() == settled.get_ref()));
    assert!(paid.iter().filter(|p| !replayed(p)).count() <= 1);
    let acc = account(&http, &shop, "acc_race").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "{acc}");

    // the bank unreachable: UNAVAILABLE, and the key is free for the retry
    let failed = create(
        &mut c,
        Some("k2"),
        new_payment("acc_b", 5),
        &[("x-simulate", "bank-error")],
    )
    .await
    .unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable);
    let ok = create(
        &mut c,
        Some("k2"),
        new_payment("acc_b", 5),
        &[("x-simulate", "bank-error")],
    )
    .await;
    assert_eq!(
        ok.unwrap_err().code(),
        Code::Unavailable,
        "released, ran again"
    );
}

/// A crash after the bank charged, then a retry of the same key: one
/// charge, the payment recorded once, under the first operation id.
async fn grpc_crash_after_bank(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("grpc-crash");
    let lease = ["--lease-ms", "2000"];
    let mut shop = start(mode, &db, &prefix, &lease).await;
    let mut c = client(&shop).await;
    let crashed = create(
        &mut c,
        Some("crash"),
        new_payment("acc_crash", 42),
        &[("x-simulate", "crash-after-bank")],
    )
    .await;
    assert!(crashed.is_err(), "{crashed:?}");
    shop.wait_exit(Duration::from_secs(10));
    drop(shop);
    let shop = start(mode, &db, &prefix, &lease).await;
    let paid = settle(
        &shop,
        "crash",
        new_payment("acc_crash", 42),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(!replayed(&paid));
    let again = settle(
        &shop,
        "crash",
        new_payment("acc_crash", 42),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), paid.get_ref());
    let acc = account(&signed_in(), &shop, "acc_crash").await;
    assert_eq!(acc["payments"], 1, "{acc}");
    assert_eq!(acc["bank_charges"], 1, "{acc}");
    assert_eq!(acc["charged_total"], 42, "{acc}");
}

/// SIGTERM while a gRPC handler whose caller gave up still runs (the call
/// cancelled by its deadline; the handler runs on, on a task of its own):
/// shop waits for it, so its answer is stored, and the retry after a
/// restart is its replay. Before, the gRPC server's drain ended with the
/// call, and the process exited with the handler cut and its claim held.
async fn grpc_sigterm_waits_for_a_handler_whose_caller_went_away(mode: Mode, db: Db) {
    let prefix = RedisPrefix::new("grpc-gone");
    let mut shop = start(mode, &db, &prefix, &[]).await;
    let mut c = client(&shop).await;
    // It gives up three seconds in (the claim made by then, even on a busy
    // machine), the bank six.
    let mut call = with(
        new_payment("acc_gone", 7),
        &[
            ("authorization", "Bearer client-1"),
            ("idempotency-key", "gone"),
            ("x-simulate", "bank-delay=6000"),
        ],
    );
    call.set_timeout(Duration::from_secs(3));
    let gave_up = c.create_payment(call).await;
    assert!(gave_up.is_err(), "the caller gave up: {gave_up:?}");
    shop.terminate();
    let status = shop.wait_exit(Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
    drop(shop);
    let shop = start(mode, &db, &prefix, &[]).await;
    let again = create(
        &mut client(&shop).await,
        Some("gone"),
        new_payment("acc_gone", 7),
        &[],
    )
    .await
    .unwrap();
    assert!(replayed(&again), "stored before the exit");
    let acc = account(&signed_in(), &shop, "acc_gone").await;
    assert_eq!(acc["bank_charges"], 1, "{acc}");
}

/// `--fault-injection off` refuses `x-simulate` over gRPC as over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_fault_injection_off_refuses_simulation() {
    let db = Db::sqlite();
    let prefix = RedisPrefix::new("grpc-fi");
    let shop = start(Mode::Sqlite, &db, &prefix, &["--fault-injection", "off"]).await;
    let mut c = client(&shop).await;
    let refused = create(
        &mut c,
        Some("k"),
        new_payment("acc_fi", 1),
        &[("x-simulate", "crash-after-bank")],
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("fault-injection"),
        "{}",
        refused.message()
    );
    let ok = create(&mut c, Some("k"), new_payment("acc_fi", 1), &[])
        .await
        .unwrap();
    assert!(!replayed(&ok));
}

/// A message larger than an HTTP body may be is refused on every method,
/// the unguarded `GetPayment` too (tonic's own limit is 4 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_messages_over_the_body_limit_are_refused_on_every_method() {
    let db = Db::sqlite();
    let prefix = RedisPrefix::new("grpc-max");
    let shop = start(Mode::Sqlite, &db, &prefix, &[]).await;
    let mut c = client(&shop).await;
    let large = c
        .get_payment(with(
            GetPaymentRequest {
                id: "p".repeat(1024 * 1024 + 1),
            },
            &[("authorization", "Bearer client-1")],
        ))
        .await
        .unwrap_err();
    // tonic's code for a message over its decoding limit (the guarded
    // method's layer answers `RESOURCE_EXHAUSTED` before tonic reads it).
    assert_eq!(large.code(), Code::OutOfRange, "{large:?}");
    assert!(large.message().contains("1048576"), "{large:?}");
    // Below it, the same call is read (and finds nothing).
    let small = c
        .get_payment(with(
            GetPaymentRequest {
                id: "p".repeat(1000),
            },
            &[("authorization", "Bearer client-1")],
        ))
        .await
        .unwrap_err();
    assert_eq!(small.code(), Code::InvalidArgument, "{small:?}");
}

in_every_mode!(
    grpc_contract,
    grpc_crash_after_bank,
    grpc_sigterm_waits_for_a_handler_whose_caller_went_away
);

/// Redis alone over gRPC, as over HTTP: a record Redis lost lets the key
/// run again, and it resumes under the operation the key was bound to
/// before the bank was called: the same payment, charged once. Another
/// payment under the key is refused (`FAILED_PRECONDITION`, as the layer
/// refuses a key reused), and so is the key over HTTP: another route is
/// another request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_redis_alone_a_lost_record_resumes_under_the_bound_operation() {
    let mode = Mode::RedisAlone;
    let db = mode.db().await;
    let prefix = RedisPrefix::new("grpc-lost");
    let shop = start(mode, &db, &prefix, &[]).await;
    let mut c = client(&shop).await;
    let lose = || idem_test_support::redis::clear_prefix(&common::redis_url(), &prefix.0);
    let first = create(&mut c, Some("k"), new_payment("acc_lost", 700), &[])
        .await
        .unwrap();
    lose();
    let again = create(&mut c, Some("k"), new_payment("acc_lost", 700), &[])
        .await
        .unwrap();
    assert!(!replayed(&again), "the record was lost");
    assert_eq!(again.get_ref(), first.get_ref(), "the payment made first");
    let acc = account(&signed_in(), &shop, "acc_lost").await;
    assert_eq!(acc["bank_charges"], 1, "{acc}");
    lose();
    let other = create(&mut c, Some("k"), new_payment("acc_lost", 5), &[])
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert_eq!(
        idem_tonic::LayerRefusal::of(&other),
        Some(idem_tonic::LayerRefusal::KeyReused),
        "said as the layer says it"
    );
    lose();
    let http = common::read(
        signed_in()
            .post(shop.url("/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k")
            .body(r#"{"account_id":"acc_lost","amount":700,"currency":"EUR"}"#),
    )
    .await;
    assert_eq!(http.status, 422, "{http:?}");
    let acc = account(&signed_in(), &shop, "acc_lost").await;
    assert_eq!(acc["bank_charges"], 1, "{acc}");
}

/// Calls whose callers gave up leave their handlers running (to store
/// their answers); shop counts them against its connection cap, so one
/// HTTP/2 connection cannot pile them up by opening and cancelling calls:
/// past the cap a new call is refused before anything is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_given_up_count_against_the_cap_until_their_handlers_end() {
    let db = Db::sqlite();
    let prefix = RedisPrefix::new("grpc-cap");
    let shop = start(Mode::Sqlite, &db, &prefix, &["--max-connections", "2"]).await;
    let mut c = client(&shop).await;
    // Each gives up three seconds in (its handler started by then, even on
    // a busy machine); the bank takes a minute.
    for key in ["cap-1", "cap-2"] {
        let mut call = with(
            new_payment("acc_cap", 7),
            &[
                ("authorization", "Bearer client-1"),
                ("idempotency-key", key),
                ("x-simulate", "bank-delay=60000"),
            ],
        );
        call.set_timeout(Duration::from_secs(3));
        let gave_up = c.create_payment(call).await;
        assert!(gave_up.is_err(), "the caller gave up: {gave_up:?}");
    }
    let refused = create(&mut c, Some("cap-3"), new_payment("acc_cap", 7), &[])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.metadata().contains_key("grpc-retry-pushback-ms"),
        "{refused:?}"
    );
    // (The count is the process's: HTTP takes no new connection meanwhile
    // either, so nothing more is asked of this shop.)
    drop(shop);
}
