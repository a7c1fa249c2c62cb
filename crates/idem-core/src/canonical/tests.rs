//! The canonicaliser against the spelling idem fingerprinted before it.

use super::*;

fn canon(s: &str) -> Result<String, CanonicalJsonError> {
    let mut out = Vec::new();
    canonicalize(s.as_bytes(), &mut out)?;
    Ok(String::from_utf8(out).unwrap_or_default())
}

#[test]
fn spellings() {
    for (input, want) in [
        (
            r#" { "b" : [ 1.0 , "\u0041" ] , "a" : null } "#,
            r#"{"a":null,"b":[1,"A"]}"#,
        ),
        (r#"{"a":1,"a":2}"#, r#"{"a":2}"#),
        (r#"{"b":1,"a":2,"b":3}"#, r#"{"a":2,"b":3}"#),
        // `"a!"` before `"a"`: `!` sorts before the closing quote.
        (r#"{"a":2,"a!":1}"#, r#"{"a!":1,"a":2}"#),
        ("-0", "0"),
        ("-0.0", "0"),
        ("1e2", "100"),
        ("12.50", "12.5"),
        ("0.000001", "0.000001"),
        ("0.0000001", "1e-7"),
        ("1e21", "1e+21"),
        ("18446744073709551615", "18446744073709551615"),
        ("18446744073709551616", "18446744073709552000"),
        ("-9223372036854775808", "-9223372036854775808"),
        ("-9223372036854775809", "-9223372036854776000"),
        ("0.1234567890123456", "0.1234567890123456"),
        (r#""\ud83d\ude00\/\u001f\u007f""#, "\"😀/\\u001f\u{7f}\""),
        (r#""\b\f\n\r\t\"\\""#, r#""\b\f\n\r\t\"\\""#),
    ] {
        assert_eq!(canon(input).ok().as_deref(), Some(want), "{input}");
    }
}

/// The spelling idem always fingerprinted: `serde_json` into a value,
/// `serde_jcs` out.
fn reference(s: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(s).ok()?;
    serde_jcs::to_vec(&value).ok()
}

/// A fixed pseudo-random sequence (no dependency, the same every run).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (self.0 >> 33) as usize % n
    }
}

const SCALARS: &[&str] = &[
    "0",
    "-0",
    "-0.0",
    "1.0",
    "1e2",
    "12.50",
    "12.5",
    "0.0000001",
    "0.000001",
    "1e21",
    "123456789012345678901",
    "-9223372036854775809",
    "18446744073709551615",
    "0.1",
    "5e-324",
    "1.7976931348623157e308",
    "1e400",
    "0.12345678901234567",
    "true",
    "false",
    "null",
    r#""""#,
    r#""\u0000""#,
    r#""\"""#,
    r#""\ud83d\ude00""#,
    r#""é""#,
    r#""\/""#,
    r#""\u001F\b\f""#,
    r#""\ud800""#,
    "\"\u{7f}\u{2028}\"",
    "01",
    "1.",
];
const KEYS: &[&str] = &[
    r#""a""#,
    r#""a!""#,
    r#""b""#,
    r#""\u0041""#,
    r#""A""#,
    r#""\t""#,
    r#""\"""#,
    r#""é""#,
    r#""\ud83d\ude00""#,
    r#""""#,
    "\"\u{ffff}\"",
];

fn document(rng: &mut Lcg, depth: usize, out: &mut String) {
    fn ws(rng: &mut Lcg, out: &mut String) {
        out.push_str([" ", "", "", "\n\t", "\r"][rng.below(5)]);
    }
    ws(rng, out);
    match if depth > 3 { 0 } else { rng.below(4) } {
        0 | 1 => out.push_str(SCALARS[rng.below(SCALARS.len())]),
        2 => {
            out.push('[');
            for i in 0..rng.below(4) {
                if i > 0 {
                    out.push(',');
                }
                document(rng, depth + 1, out);
            }
            out.push(']');
        }
        _ => {
            out.push('{');
            for i in 0..rng.below(5) {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                out.push_str(KEYS[rng.below(KEYS.len())]);
                ws(rng, out);
                out.push(':');
                document(rng, depth + 1, out);
            }
            out.push('}');
        }
    }
    ws(rng, out);
}

#[test]
fn agrees_with_the_spelling_fingerprinted_before() {
    let mut rng = Lcg(0x9e37_79b9_7f4a_7c15);
    let (mut valid, mut refused) = (0, 0);
    for _ in 0..20_000 {
        let mut doc = String::new();
        document(&mut rng, 0, &mut doc);
        // Now and then a byte cut out, to reach the refusals too.
        if rng.below(5) == 0 && !doc.is_empty() {
            let at = rng.below(doc.len());
            if doc.is_char_boundary(at) && doc.is_char_boundary(at + 1) {
                doc.remove(at);
            }
        }
        let mine = canon(&doc).ok().map(String::into_bytes);
        assert_eq!(mine, reference(doc.as_bytes()), "{doc:?}");
        if mine.is_some() {
            valid += 1;
        } else {
            refused += 1;
        }
    }
    assert!(
        valid > 5_000 && refused > 1_000,
        "{valid} valid, {refused} refused"
    );
}

#[test]
fn refusals() {
    let deep_ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
    assert!(canon(&deep_ok).is_ok());
    let too_deep = format!("{}{}", "[".repeat(128), "]".repeat(128));
    for input in [
        "",
        " ",
        "01",
        "1.",
        ".5",
        "-",
        "1e",
        "1e400",
        "[1,]",
        "{\"a\":1,}",
        "{a:1}",
        "\"\\ud800\"",
        "\"\\udc00\"",
        "\"\\ud800\\u0041\"",
        "\"\u{1}\"",
        "\"\\x\"",
        "\"abc",
        "tru",
        "nul",
        "[1] 2",
        "\u{feff}1",
        &too_deep,
    ] {
        assert!(canon(input).is_err(), "{input:?}");
    }
    assert!(canonicalize(b"\"\xff\"", &mut Vec::new()).is_err());
}

#[test]
fn serde_json_private_raw_value_key_is_an_ordinary_key() {
    // serde_json built with `raw_value` reads such an object as the JSON text
    // in its value; idem's fingerprints used to inherit that in those builds
    // (two different bodies, one fingerprint). Now it is an object like any
    // other, whatever the build.
    let wrapped = r#"{"$serde_json::private::RawValue":"{\"a\":1}"}"#;
    assert_eq!(canon(wrapped).ok().as_deref(), Some(wrapped));
    assert_ne!(canon(wrapped).ok(), canon(r#"{"a":1}"#).ok());
}
