//! `IdempotencyKey::parse` and `IdempotencyKey::from_header_values` on
//! arbitrary bytes.
//!
//! Properties:
//! - never panics;
//! - an accepted key is 1..=255 characters of visible ASCII (0x21..=0x7E);
//! - the bare form is exactly "trim spaces and tabs, then 1..=255 visible
//!   ASCII bytes": accepted iff so, and the key is the trimmed value;
//! - the quoted form accepts exactly the Structured Field serialisation of the
//!   key (`"` + the key with `\` and `"` escaped + `"`);
//! - `parse(key.as_str())` gives the same key (for every key that does not
//!   itself start with `"`, which the bare form cannot spell) and
//!   `parse(quote(key))` always does;
//! - errors say the truth (`TooLong` carries a length over the limit,
//!   `InvalidCharacter` points at that byte);
//! - `from_header_values` is "none: Missing, several: Repeated, one: parse".
#![no_main]

use idem_core::{IdempotencyKey, KeyError, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

/// The Structured Field string spelling of a key.
fn quote(key: &str) -> Vec<u8> {
    let mut out = vec![b'"'];
    for b in key.bytes() {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

fn check_accepted(key: &IdempotencyKey) {
    let s = key.as_str();
    assert!(
        (1..=MAX_KEY_LEN).contains(&s.len()),
        "accepted a key of {} bytes: {s:?}",
        s.len()
    );
    assert_eq!(s.chars().count(), s.len(), "non-ASCII key {s:?}");
    assert!(s.bytes().all(visible), "key outside visible ASCII: {s:?}");
    assert_eq!(key.to_string(), s);
    // The Structured Field spelling is always the same key.
    assert_eq!(
        IdempotencyKey::parse(&quote(s)).as_ref(),
        Ok(key),
        "quoted spelling of {s:?}"
    );
    // So is the bare one, unless the key starts with a quote (then the bare
    // value would be read as a Structured Field string).
    if !s.starts_with('"') {
        assert_eq!(
            IdempotencyKey::parse(s.as_bytes()).as_ref(),
            Ok(key),
            "bare spelling of {s:?}"
        );
    }
}

fn check_parse(value: &[u8]) -> Result<IdempotencyKey, KeyError> {
    let parsed = IdempotencyKey::parse(value);
    let trimmed = trim_ows(value);
    match &parsed {
        Ok(key) => check_accepted(key),
        Err(KeyError::TooLong { len }) => assert!(*len > MAX_KEY_LEN, "TooLong {{ len: {len} }}"),
        Err(_) => {}
    }
    if trimmed.first() == Some(&b'"') {
        // Quoted: accepted only in the one canonical spelling.
        if let Ok(key) = &parsed {
            assert_eq!(
                quote(key.as_str()),
                trimmed,
                "quoted value {:?} accepted as {:?}",
                String::from_utf8_lossy(value),
                key.as_str()
            );
        }
    } else {
        // Bare: the oracle is simple.
        let expect_ok =
            (1..=MAX_KEY_LEN).contains(&trimmed.len()) && trimmed.iter().all(|b| visible(*b));
        match &parsed {
            Ok(key) => {
                assert!(expect_ok);
                assert_eq!(key.as_str().as_bytes(), trimmed);
            }
            Err(KeyError::Empty) => assert!(trimmed.is_empty()),
            Err(KeyError::TooLong { len }) => assert_eq!(*len, trimmed.len()),
            Err(KeyError::InvalidCharacter { byte, position }) => {
                assert!(trimmed.len() <= MAX_KEY_LEN);
                assert_eq!(trimmed.get(*position), Some(byte));
                assert!(!visible(*byte));
                assert!(trimmed[..*position].iter().all(|b| visible(*b)));
            }
            Err(e) => panic!(
                "bare value {:?} rejected with {e:?}",
                String::from_utf8_lossy(value)
            ),
        }
        assert_eq!(parsed.is_ok(), expect_ok);
    }
    parsed
}

fuzz_target!(|data: &[u8]| {
    let whole = check_parse(data);

    // The same bytes as a list of header values, split on '\n'.
    let values: Vec<&[u8]> = if data.is_empty() {
        Vec::new()
    } else {
        data.split(|b| *b == b'\n').collect()
    };
    let from_values = IdempotencyKey::from_header_values(values.iter().copied());
    match values.as_slice() {
        [] => assert_eq!(from_values, Err(KeyError::Missing)),
        [one] => {
            assert_eq!(from_values, check_parse(one));
            if !data.contains(&b'\n') {
                assert_eq!(from_values, whole);
            }
        }
        many => assert_eq!(from_values, Err(KeyError::Repeated { count: many.len() })),
    }
});
