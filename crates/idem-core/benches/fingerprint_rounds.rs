//! The canonical fingerprint against the raw hash of the same bytes,
//! measured in alternated rounds: each round times every variant back to
//! back. Reported: each variant's fastest round over the raw hash's
//! fastest, and the median of the rounds' own ratios. The first is the
//! code's cost; the second moves with the machine: on this virtual
//! machine, spells that slow the parser by half leave the CPU's SHA unit
//! as fast as before, so the same build's median ratio at 1 KiB read 3.3
//! in one run and 5.5 in another, while its fastest rounds agreed within a
//! few hundredths. (Criterion's `core` bench times one variant after
//! another, so a spell can fall on one variant and not the other.)
//!
//! `cargo bench -p idem-core --bench fingerprint_rounds [-- ROUNDS]`; one
//! line per body size, read by `bench/render.py`:
//!
//! ```text
//! fingerprint-rounds 1KiB rounds=301 raw_ns=846 json/raw=3.20 canon/raw=2.42 serde/raw=2.20 median json/raw=3.31 canon/raw=2.49 serde/raw=2.57
//! ```
//!
//! - `json`: the fingerprint of the JSON body (canonicalised, then hashed);
//! - `raw`: the fingerprint of the same bytes taken as they are;
//! - `canon`: the fingerprint of the same body already canonical (the
//!   parse without the reordering of members);
//! - `serde`: `serde_json` validating the body into nothing, plus the raw
//!   hash: a parse that writes nothing.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Instant;

use idem_core::Fingerprint;

mod body;
use body::json_body;

/// Nanoseconds per call of `f`, over `n` calls.
fn time(n: usize, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..n {
        f();
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; a bare number is the rounds.
    let rounds = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(301);
    for (size, name) in [(1024, "1KiB"), (64 * 1024, "64KiB")] {
        let body = json_body(size);
        let canonical = idem_core::fingerprint::canonical_json(&body).expect("the body is JSON");
        let json = || {
            black_box(Fingerprint::of_request(
                "POST",
                "/orders",
                Some("application/json"),
                black_box(&body),
            ));
        };
        let raw = || {
            black_box(Fingerprint::of_request(
                "POST",
                "/orders",
                Some("text/plain"),
                black_box(&body),
            ));
        };
        let canon = || {
            black_box(Fingerprint::of_request(
                "POST",
                "/orders",
                Some("application/json"),
                black_box(&canonical),
            ));
        };
        let serde = || {
            serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).unwrap();
            raw();
        };
        // About a millisecond of hashing per variant per round.
        let calls = (1 << 20) / size;
        for f in [&json as &dyn Fn(), &raw, &canon, &serde] {
            time(calls, f);
        }
        // Per variant, the time of each round; per round, each variant's
        // time over the raw hash's in the same round.
        let mut times = [(); 4].map(|()| Vec::with_capacity(rounds));
        let mut ratios = [(); 3].map(|()| Vec::with_capacity(rounds));
        for _ in 0..rounds {
            let r = time(calls, raw);
            times[0].push(r);
            for (n, f) in [&json as &dyn Fn(), &canon, &serde].into_iter().enumerate() {
                let t = time(calls, f);
                times[n + 1].push(t);
                ratios[n].push(t / r);
            }
        }
        let [raw, json, canon, serde] = times.map(|t| t.into_iter().fold(f64::INFINITY, f64::min));
        let [json_median, canon_median, serde_median] = ratios.map(median);
        println!(
            "fingerprint-rounds {name} rounds={rounds} raw_ns={raw:.0} json/raw={:.2} \
             canon/raw={:.2} serde/raw={:.2} median json/raw={json_median:.2} \
             canon/raw={canon_median:.2} serde/raw={serde_median:.2}",
            json / raw,
            canon / raw,
            serde / raw,
        );
    }
}
