//! Replaying stored headers: `StoredResponse::decode_headers` on what a store
//! gave back, then the `http::HeaderMap` the axum layer builds from it at
//! replay (`idem_axum::replayed_headers`, the function `replay` calls: the
//! stored pairs the policy replays, valid as a name and a value, at most
//! 1,024 of them, then `idempotent-replayed: true`).
//!
//! The first input byte picks the mode: 0 a stored header blob (the rest of
//! the input), 1 (name, value) pairs built with `arbitrary`, 2 a blob of
//! many headers (`u16` count, a flag byte: distinct names or not, a value;
//! `IDEM_FUZZ_MAX_HEADERS` caps the count).
//!
//! Properties:
//! - never panics, whatever the stored bytes;
//! - the replayed map holds exactly the valid, allow-listed stored pairs, in
//!   order, the first 1,024 of them, plus `idempotent-replayed: true` (once,
//!   whatever was stored under that name);
//! - valid (name, value) pairs survive encode -> decode unchanged, and so do
//!   arbitrary ones.
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use http::{HeaderMap, HeaderName, HeaderValue};
use idem_core::{Policy, StoredResponse};
use libfuzzer_sys::fuzz_target;

const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The characters of an HTTP token (RFC 9110 `tchar`), upper case included:
/// `HeaderName::from_bytes` lowercases.
const TCHAR: &[u8] =
    b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";

/// Pairs as a handler could have answered them (names and values mapped
/// onto valid ones), and arbitrary ones.
#[derive(Arbitrary, Debug)]
struct Pairs {
    valid: Vec<(Vec<u8>, Vec<u8>)>,
    raw: Vec<(String, Vec<u8>)>,
}

/// Maps arbitrary bytes onto a valid header name (never empty): half the
/// time one the policy replays.
fn valid_name(raw: &[u8]) -> String {
    if let Some(first) = raw.first().filter(|b| *b % 2 == 0) {
        return PICKED[usize::from(*first / 2) % PICKED.len()].to_owned();
    }
    let mut name: String = raw
        .iter()
        .map(|b| char::from(TCHAR[usize::from(*b) % TCHAR.len()]))
        .collect();
    if name.is_empty() {
        name.push('x');
    }
    name
}

/// Maps arbitrary bytes onto a valid header value: visible ASCII, space,
/// tab and obs-text (0x80..=0xFF); no other controls.
fn valid_value(raw: &[u8]) -> Vec<u8> {
    raw.iter()
        .map(|b| match b {
            0x00..=0x08 | 0x0a..=0x1f | 0x7f => b' ' + (b % 0x5f),
            _ => *b,
        })
        .collect()
}

fn encode(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    StoredResponse {
        status: 201,
        headers: headers.to_vec(),
        body: Vec::new().into(),
    }
    .encode_headers()
}

/// The names the fuzz policy replays beyond the defaults.
const ALLOWED: &[&str] = &["x-h0", "x-h1", "x-h2", "x-h3", "x-a"];

/// Names `valid_name` picks from half the time: allow-listed ones, the
/// defaults, and ones no policy ever replays.
const PICKED: &[&str] = &[
    "x-h0",
    "x-h1",
    "x-h2",
    "x-h3",
    "x-a",
    "location",
    "etag",
    "set-cookie",
    "transfer-encoding",
    "content-length",
    "idempotent-replayed",
];

/// The most stored headers a replay sends.
const MAX_REPLAYED: usize = 1024;

fn policy() -> &'static Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    POLICY.get_or_init(|| {
        let mut builder = Policy::builder();
        for name in ALLOWED {
            builder = builder.replay_header(*name);
        }
        builder
            .build()
            .expect("the fuzz policy is valid: a misconfigured one would fuzz less")
    })
}

/// What the axum layer replays of stored headers.
fn replay(stored: &[(String, Vec<u8>)]) -> HeaderMap {
    idem_axum::replayed_headers(stored, policy())
}

/// Decodes a stored blob and replays it, checking the map against the pairs.
fn replay_blob(blob: &[u8]) {
    let Ok(stored) = StoredResponse::decode_headers(blob) else {
        return;
    };
    let map = replay(&stored);
    let expected: Vec<(HeaderName, HeaderValue)> = stored
        .iter()
        .filter_map(|(n, v)| {
            Some((
                HeaderName::from_bytes(n.as_bytes()).ok()?,
                HeaderValue::from_bytes(v).ok()?,
            ))
        })
        .filter(|(n, _)| policy().replays_header(n.as_str()))
        .take(MAX_REPLAYED)
        .collect();
    assert_eq!(map.len(), expected.len() + 1);
    let replayed: Vec<_> = map.get_all(&IDEMPOTENT_REPLAYED).iter().collect();
    assert_eq!(replayed, [&HeaderValue::from_static("true")]);
    let mut want: HashMap<&HeaderName, Vec<&HeaderValue>> = HashMap::new();
    for (name, value) in &expected {
        want.entry(name).or_default().push(value);
    }
    for (name, values) in want {
        let got: Vec<&HeaderValue> = map.get_all(name).iter().collect();
        assert_eq!(got, values, "values of {name}");
    }
}

fn check_pairs(Pairs { valid, raw }: Pairs) {
    let valid: Vec<(String, Vec<u8>)> = valid
        .iter()
        .map(|(n, v)| (valid_name(n), valid_value(v)))
        .collect();
    for (n, v) in &valid {
        assert!(HeaderName::from_bytes(n.as_bytes()).is_ok(), "{n:?}");
        assert!(HeaderValue::from_bytes(v).is_ok(), "{v:?}");
    }
    let blob = encode(&valid);
    assert_eq!(StoredResponse::decode_headers(&blob).as_ref(), Ok(&valid));
    replay_blob(&blob);

    let blob = encode(&raw);
    assert_eq!(StoredResponse::decode_headers(&blob).as_ref(), Ok(&raw));
    replay_blob(&blob);
}

/// The largest header count mode 2 builds: `IDEM_FUZZ_MAX_HEADERS`, 65535 if
/// unset. From 24576 distinct names on, the replay panics
/// (`HeaderMap::append`: "size overflows MAX_SIZE", see
/// corpus/header_replay/regress-headermap-overflow-*); a lower cap lets a long
/// run look past that known crash and keeps mode 2 cheap (a blob of 24k
/// headers takes about 0.25 s to check).
fn max_headers() -> u16 {
    static MAX: OnceLock<u16> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("IDEM_FUZZ_MAX_HEADERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(u16::MAX)
    })
}

/// A stored blob with many headers (a large or hostile record): `count`
/// pairs with one value, names all distinct or four names repeated.
fn check_many(count: u16, distinct: bool, value: &[u8]) {
    let value = valid_value(value);
    let pairs: Vec<(String, Vec<u8>)> = (0..count.min(max_headers()))
        .map(|i| {
            let name = if distinct {
                format!("x-h{i}")
            } else {
                format!("x-h{}", i % 4)
            };
            (name, value.clone())
        })
        .collect();
    replay_blob(&encode(&pairs));
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks what the rest is.
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        // What a store gave back.
        0 => replay_blob(rest),
        1 => {
            if let Ok(pairs) = Pairs::arbitrary_take_rest(Unstructured::new(rest)) {
                check_pairs(pairs);
            }
        }
        _ => {
            if let [hi, lo, flags, value @ ..] = rest {
                check_many(u16::from_be_bytes([*hi, *lo]), flags % 2 == 1, value);
            }
        }
    }
});
