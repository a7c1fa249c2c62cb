//! `canonical_json` (RFC 8785) and `Fingerprint::of_request` on arbitrary
//! bodies.
//!
//! Properties:
//! - never panics;
//! - the one-pass canonicaliser gives, byte for byte, what idem fingerprinted
//!   before it (`serde_json` into a value, `serde_jcs` out), and refuses
//!   exactly what that refused: records stored before stay comparable (but
//!   for bodies holding serde_json's private raw-value key, see
//!   `SERDE_JSON_RAW_VALUE`, bodies holding a number beyond a double's
//!   precision, which keeps its exact value now: see `lossy`, and bodies
//!   holding a key twice in an object, refused now: see `duplicate_keys`);
//! - the canonical output is valid JSON whose value equals the input's value
//!   (numbers compared as JSON numbers: integers exactly, anything with a
//!   fraction or exponent as the IEEE double it denotes);
//! - canonicalising the canonical output gives it back (a fixed point);
//! - a JSON body and other spellings of the same value (re-serialised pretty
//!   by serde_json; and written with object keys in reverse order, random
//!   insignificant whitespace and every string character `\u`-escaped) get
//!   the same fingerprint;
//! - the fingerprint reads the body as JSON exactly when the content type is
//!   JSON and the body canonicalises;
//! - a request with arbitrary method, path and content type never panics.
#![no_main]

use idem_core::fingerprint::{canonical_json, is_json_media_type, BodyForm};
use idem_core::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

// The same oracle as idem-core's unit tests: exact values, the old
// spelling's changes, where a document's numbers are.
#[path = "../../crates/idem-core/src/canonical/oracle.rs"]
mod oracle;
use oracle::{duplicate_keys, exact, lossy, number_spans};

const JSON: Option<&str> = Some("application/json");

/// Equality of JSON values, numbers compared by the number they denote.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            if let (Some(x), Some(y)) = (x.as_i64(), y.as_i64()) {
                x == y
            } else if let (Some(x), Some(y)) = (x.as_u64(), y.as_u64()) {
                x == y
            } else {
                x.as_f64() == y.as_f64()
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// Whether the JSON document `doc` holds a [`lossy`] number.
fn holds_lossy(doc: &[u8]) -> bool {
    std::str::from_utf8(doc)
        .is_ok_and(|doc| number_spans(doc).into_iter().any(|at| lossy(&doc[at])))
}

/// `doc` with each number spelled otherwise, its value the same: a zero
/// more at the end of its fraction (`.0` if it has none), and `e0` if it
/// has no exponent.
fn respelled(doc: &str) -> String {
    let mut out = String::with_capacity(doc.len() * 2);
    let mut at = 0;
    for span in number_spans(doc) {
        out.push_str(&doc[at..span.start]);
        let number = &doc[span.clone()];
        let (mantissa, e) = match number.find(['e', 'E']) {
            Some(x) => number.split_at(x),
            None => (number, "e0"),
        };
        out.push_str(mantissa);
        out.push_str(if mantissa.contains('.') { "0" } else { ".0" });
        out.push_str(e);
        at = span.end;
    }
    out.push_str(&doc[at..]);
    out
}

/// Checks the numbers of an accepted body: each number written has the
/// exact value of a number sent, and the body with every number respelled
/// canonicalises to the same bytes.
fn check_numbers(body: &[u8], canonical: &[u8]) {
    let (Ok(body), Ok(written)) = (std::str::from_utf8(body), std::str::from_utf8(canonical))
    else {
        return;
    };
    let sent: Vec<_> = number_spans(body)
        .into_iter()
        .map(|at| exact(&body[at]))
        .collect();
    for at in number_spans(written) {
        let number = &written[at];
        assert!(
            sent.contains(&exact(number)),
            "{number} written, a value {body:?} did not send"
        );
    }
    let other = respelled(body);
    assert_eq!(
        canonical_json(other.as_bytes()).ok().as_deref(),
        Some(canonical),
        "{body:?} respelled as {other:?}"
    );
}

/// Writes `v` as JSON in an unusual but equivalent spelling: object members
/// in reverse order, whitespace between tokens chosen by `ws`, every string
/// character past ASCII letters and digits `\u`-escaped (surrogate pairs
/// included).
fn write_variant(v: &Value, ws: &mut impl Iterator<Item = u8>, out: &mut Vec<u8>) {
    fn space(ws: &mut impl Iterator<Item = u8>, out: &mut Vec<u8>) {
        let b = ws.next().unwrap_or(0);
        for i in 0..(b % 4) {
            out.push([b' ', b'\n', b'\t', b'\r'][usize::from((b >> (2 + i)) & 3)]);
        }
    }
    fn string(s: &str, out: &mut Vec<u8>) {
        out.push(b'"');
        for c in s.chars() {
            if c.is_ascii_alphanumeric() {
                out.push(c as u8);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.extend_from_slice(format!("\\u{u:04X}").as_bytes());
                }
            }
        }
        out.push(b'"');
    }
    space(ws, out);
    match v {
        Value::Null | Value::Bool(_) | Value::Number(_) => {
            out.extend_from_slice(serde_json::to_string(v).unwrap().as_bytes())
        }
        Value::String(s) => string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_variant(item, ws, out);
            }
            space(ws, out);
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            for (i, (k, item)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                space(ws, out);
                string(k, out);
                space(ws, out);
                out.push(b':');
                write_variant(item, ws, out);
            }
            space(ws, out);
            out.push(b'}');
        }
    }
    space(ws, out);
}

/// The key that makes `serde_json`, built with its `raw_value` feature (as
/// axum's `json` feature builds it), read an object as the JSON text held in
/// its string value. The old canonicaliser inherited that, in such builds
/// only: `{"$serde_json::private::RawValue":"{\"a\":1}"}` then shared the
/// fingerprint of `{"a":1}`. The one-pass canonicaliser reads it as the
/// ordinary object it is, so neither serde_json nor the old spelling is a
/// reference for a body that holds it.
const SERDE_JSON_RAW_VALUE: &[u8] = b"$serde_json::private::RawValue";

fn holds(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn check_body(body: &[u8]) {
    let canonical = canonical_json(body);
    if holds(body, SERDE_JSON_RAW_VALUE)
        || canonical
            .as_ref()
            .is_ok_and(|c| holds(c, SERDE_JSON_RAW_VALUE))
    {
        // Only that it does not panic, and is a fixed point.
        if let Ok(c) = canonical {
            assert_eq!(canonical_json(&c).ok(), Some(c));
        }
        return;
    }
    if duplicate_keys(body) == Some(true) {
        // serde_json kept the last of the two; another parser keeps the
        // first. Refused, so fingerprinted as the bytes.
        // (Or refused before that object closes, for a number whose
        // exponent does not fit 64 bits, which serde_json read as zero.)
        let e = canonical.expect_err("a key twice is refused");
        let e = e.to_string();
        assert!(
            e.contains(": duplicate key in the object") || e.contains(": number out of range"),
            "{e}"
        );
        let (fingerprint, form) = Fingerprint::of_request_with_form("POST", "/p", JSON, body);
        assert_eq!(form, BodyForm::Raw);
        assert_eq!(
            fingerprint,
            Fingerprint::of_request("POST", "/p", Some("text/plain"), body)
        );
        return;
    }
    let parsed: Result<Value, _> = serde_json::from_slice(body);
    let reference = parsed.as_ref().ok().and_then(|v| serde_jcs::to_vec(v).ok());
    if let Ok(c) = &canonical {
        check_numbers(body, c);
    }
    if reference.is_some() && holds_lossy(body) {
        // The old spelling rounded a number to a double; now it keeps its
        // value. Still refused only what serde_json refused (and a number
        // whose exponent does not fit 64 bits, which it reads as zero), a
        // fixed point, and the value of the old spelling once rounded.
        let c = match canonical {
            Ok(c) => c,
            Err(e) => {
                assert!(e.to_string().contains("number out of range"), "{e}");
                return;
            }
        };
        assert_eq!(
            canonical_json(&c).ok().as_ref(),
            Some(&c),
            "not a fixed point"
        );
        let rounded: Value = serde_json::from_slice(&c).expect("the canonical output is JSON");
        assert!(same_value(&rounded, parsed.as_ref().expect("parsed")));
        return;
    }
    assert_eq!(
        canonical.as_ref().ok().map(|c| String::from_utf8_lossy(c)),
        reference.as_ref().map(|c| String::from_utf8_lossy(c)),
        "the one-pass canonicaliser and the reference differ on {:?}",
        String::from_utf8_lossy(body)
    );
    let (fingerprint, form) = Fingerprint::of_request_with_form("POST", "/p", JSON, body);
    assert_eq!(
        fingerprint,
        Fingerprint::of_request("POST", "/p", JSON, body)
    );
    let canonical = match (canonical, parsed) {
        (Ok(c), Ok(v)) => {
            assert_eq!(form, BodyForm::CanonicalJson);
            (c, v)
        }
        (Err(_), _) => {
            assert_eq!(form, BodyForm::Raw);
            // Fingerprinted raw: the same as any raw body with these bytes.
            assert_eq!(
                fingerprint,
                Fingerprint::of_request("POST", "/p", Some("text/plain"), body)
            );
            return;
        }
        (Ok(c), Err(e)) => panic!(
            "canonicalised {:?} into {:?}, but it does not parse: {e}",
            String::from_utf8_lossy(body),
            String::from_utf8_lossy(&c)
        ),
    };
    let (c, value) = canonical;
    let reparsed: Value = serde_json::from_slice(&c).unwrap_or_else(|e| {
        panic!(
            "canonical output {:?} is not JSON: {e}",
            String::from_utf8_lossy(&c)
        )
    });
    assert!(
        same_value(&value, &reparsed),
        "canonical output changes the value: {value:?} became {:?} ({reparsed:?})",
        String::from_utf8_lossy(&c)
    );
    assert!(std::str::from_utf8(&c).is_ok());
    let again = canonical_json(&c).expect("the canonical output canonicalises");
    assert_eq!(
        String::from_utf8_lossy(&again),
        String::from_utf8_lossy(&c),
        "not a fixed point (input {:?})",
        String::from_utf8_lossy(body)
    );

    // Other spellings of the same value, the same fingerprint.
    let pretty = serde_json::to_vec_pretty(&value).expect("a Value serialises");
    assert_eq!(
        Fingerprint::of_request("POST", "/p", JSON, &pretty),
        fingerprint,
        "{:?} and its pretty spelling {:?} differ",
        String::from_utf8_lossy(body),
        String::from_utf8_lossy(&pretty)
    );
    let mut variant = Vec::new();
    write_variant(&value, &mut body.iter().copied().cycle(), &mut variant);
    assert_eq!(
        Fingerprint::of_request(
            "POST",
            "/p",
            Some("application/problem+json; charset=utf-8"),
            &variant
        ),
        fingerprint,
        "{:?} and its variant spelling {:?} differ",
        String::from_utf8_lossy(body),
        String::from_utf8_lossy(&variant)
    );
}

fuzz_target!(|data: &[u8]| {
    check_body(data);

    // The whole request from the same bytes: "method\npath\ncontent-type\nbody".
    let mut parts = data.splitn(4, |b| *b == b'\n');
    let (Some(method), Some(path), Some(ct), Some(body)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let (Ok(method), Ok(path), Ok(ct)) = (
        std::str::from_utf8(method),
        std::str::from_utf8(path),
        std::str::from_utf8(ct),
    ) else {
        return;
    };
    let (f, form) = Fingerprint::of_request_with_form(method, path, Some(ct), body);
    let json = is_json_media_type(ct);
    assert_eq!(
        form == BodyForm::CanonicalJson,
        json && canonical_json(body).is_ok()
    );
    if form == BodyForm::CanonicalJson && !holds(body, SERDE_JSON_RAW_VALUE) && !holds_lossy(body) {
        let pretty =
            serde_json::to_vec_pretty(&serde_json::from_slice::<Value>(body).unwrap()).unwrap();
        assert_eq!(f, Fingerprint::of_request(method, path, JSON, &pretty));
    } else if form == BodyForm::Raw {
        assert_eq!(f, Fingerprint::of_request(method, path, None, body));
    }
    assert_eq!(f.to_hex().len(), 64);
    assert_eq!(Fingerprint::from_slice(f.as_bytes()), Some(f));
});
