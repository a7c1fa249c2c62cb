//! Micro-benchmarks of the pure core: key parsing, canonical-JSON
//! fingerprints of 1 KiB and 64 KiB bodies (with the raw hash, an already
//! canonical body and serde_json's validation of the same bytes beside
//! them), and the decision function.
#![allow(missing_docs, clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use idem_core::{
    on_arrival, FencingToken, Fingerprint, IdempotencyKey, OperationId, Policy, Record,
    RecordState, UnixMillis,
};

mod body;
use body::json_body;

fn benches(c: &mut Criterion) {
    c.bench_function("key/bare", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324")))
    });
    c.bench_function("key/structured", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)))
    });
    for size in [1024, 64 * 1024] {
        let body = json_body(size);
        let mut g = c.benchmark_group("fingerprint");
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(format!("json/{}KiB", size / 1024), |b| {
            b.iter(|| {
                Fingerprint::of_request(
                    "POST",
                    "/orders",
                    Some("application/json"),
                    black_box(&body),
                )
            })
        });
        g.bench_function(format!("raw/{}KiB", size / 1024), |b| {
            b.iter(|| {
                Fingerprint::of_request("POST", "/orders", Some("text/plain"), black_box(&body))
            })
        });
        // Two ceilings beside them: the same body already canonical (the
        // parse without the reordering), and serde_json validating it alone
        // (a parse that writes nothing). Names short enough for criterion
        // to print each on one line, which bench/run.sh reads.
        let canonical = idem_core::fingerprint::canonical_json(&body).unwrap();
        g.bench_function(format!("canon/{}KiB", size / 1024), |b| {
            b.iter(|| {
                Fingerprint::of_request(
                    "POST",
                    "/orders",
                    Some("application/json"),
                    black_box(&canonical),
                )
            })
        });
        g.bench_function(format!("serde/{}KiB", size / 1024), |b| {
            b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).unwrap())
        });
        g.finish();
    }
    let policy = Policy::default();
    let fp = Fingerprint::of_request("POST", "/p", None, b"{}");
    let record = Record {
        scope: "s".into(),
        key: "k".into(),
        fingerprint: fp,
        operation_id: OperationId::generate(),
        created_at: UnixMillis(0),
        expires_at: UnixMillis(i64::MAX),
        shortest_retention: None,
        state: RecordState::InProgress {
            token: FencingToken(1),
            locked_until: UnixMillis(i64::MAX),
        },
    };
    c.bench_function("decide/in-flight", |b| {
        b.iter(|| {
            on_arrival(
                black_box(&policy),
                Some(black_box(&record)),
                &fp,
                UnixMillis(1),
            )
        })
    });
}

criterion_group!(core, benches);
criterion_main!(core);
