//! The canonicaliser against the spelling idem fingerprinted before it.

use super::oracle::{duplicate_keys, lossy, number_spans};
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
        ("18446744073709551616", "18446744073709551616"),
        ("-9223372036854775808", "-9223372036854775808"),
        ("-9223372036854775809", "-9223372036854775809"),
        ("0.1234567890123456", "0.1234567890123456"),
        (r#""\ud83d\ude00\/\u001f\u007f""#, "\"😀/\\u001f\u{7f}\""),
        (r#""\b\f\n\r\t\"\\""#, r#""\b\f\n\r\t\"\\""#),
    ] {
        assert_eq!(canon(input).ok().as_deref(), Some(want), "{input}");
    }
}

/// The spelling idem fingerprinted before numbers kept their exact value
/// and duplicate keys were refused: `serde_json` into a value, `serde_jcs`
/// out. It still is the spelling of every document without a [`lossy`]
/// number; a document with a key twice (which `serde_json` read as its
/// last) is refused now.
fn reference(s: &[u8]) -> Option<Vec<u8>> {
    if duplicate_keys(s)? {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(s).ok()?;
    serde_jcs::to_vec(&value).ok()
}

#[test]
fn the_lossy_oracle() {
    for n in [
        "1",
        "-1.5",
        "1e400",
        "18446744073709551615",
        "0.1",
        "5e-324",
        "1e21",
    ] {
        assert!(!lossy(n), "{n}");
    }
    for n in [
        "18446744073709551616",
        "9.000000000000001",
        "1e-400",
        "0.12345678901234567",
        // Half-way between the two shortest spellings of its double, which
        // ECMAScript (and the old spelling) writes `…099.2`.
        "900719925474099.3",
    ] {
        assert!(lossy(n), "{n}");
    }
    let doc = r#"{"a\"1":[1.5,-2e3,true],"b":"3","c":4}"#;
    let found: Vec<&str> = number_spans(doc).into_iter().map(|at| &doc[at]).collect();
    assert_eq!(found, ["1.5", "-2e3", "4"]);
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
    "1e-400",
    "12345678901234567890123",
    "900719925474099.3",
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
    let (mut valid, mut refused, mut twice) = (0, 0, 0);
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
        let before = reference(doc.as_bytes());
        if duplicate_keys(doc.as_bytes()) == Some(true) {
            // What the old spelling read as its last member, refused.
            assert!(refusal(&doc).starts_with(DUPLICATE_KEY), "{doc:?}");
            twice += 1;
        }
        if number_spans(&doc).into_iter().any(|at| lossy(&doc[at])) && before.is_some() {
            // The old spelling rounded such a number to a double; the
            // value itself is kept now (`numbers_keep_their_exact_value`),
            // which rounded is the old spelling.
            let kept = mine.as_deref().unwrap_or_else(|| panic!("{doc:?} refused"));
            let again: serde_json::Value = serde_json::from_slice(kept).unwrap_or_default();
            assert_eq!(serde_jcs::to_vec(&again).ok(), before, "{doc:?}");
        } else {
            assert_eq!(mine, before, "{doc:?}");
        }
        if mine.is_some() {
            valid += 1;
        } else {
            refused += 1;
        }
    }
    assert!(
        valid > 5_000 && refused > 1_000 && twice > 500,
        "{valid} valid, {refused} refused ({twice} for a key twice)"
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

/// The message of a refusal, e.g. `nested too deep at byte 127`.
fn refusal(s: &str) -> String {
    match canon(s) {
        Ok(out) => panic!("{s:?} accepted as {out:?}"),
        Err(e) => e.0,
    }
}

/// Asserts each input canonicalises to exactly the bytes given.
fn assert_spellings(cases: &[(&str, &str)]) {
    for &(input, want) in cases {
        assert_eq!(canon(input).ok().as_deref(), Some(want), "{input:?}");
    }
}

#[test]
fn nesting_limit_is_exactly_128_in_arrays_and_objects() {
    let arrays = |n| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let objects = |n| format!("{}0{}", r#"{"a":"#.repeat(n), "}".repeat(n));
    let mixed = |n: usize| {
        let open: String = (0..n)
            .map(|i| if i % 2 == 0 { "[" } else { r#"{"k":"# })
            .collect();
        let close: String = (0..n)
            .rev()
            .map(|i| if i % 2 == 0 { "]" } else { "}" })
            .collect();
        format!("{open}0{close}")
    };
    for deep in [arrays(127), objects(127), mixed(127)] {
        assert_eq!(canon(&deep).ok().as_deref(), Some(deep.as_str()));
    }
    // The 128th opening bracket is refused where it stands.
    assert_eq!(refusal(&arrays(128)), "nested too deep at byte 127");
    assert_eq!(refusal(&objects(128)), "nested too deep at byte 635");
    // 64 `[` and 63 `{"k":` before it.
    assert_eq!(refusal(&mixed(128)), "nested too deep at byte 379");
}

#[test]
fn closing_a_container_gives_its_depth_back() {
    // Many siblings, each entered and left: the depth returns to 1 each time.
    for doc in [
        format!("[{}[]]", "[],".repeat(300)),
        format!("[{}{{}}]", "{},".repeat(300)),
        format!("[{}0]", r#"{"a":[{}]},"#.repeat(300)),
        format!(
            "{{{}\"z\":0}}",
            (0..300)
                .map(|i| format!(r#""k{i:03}":[],"#))
                .collect::<String>()
        ),
    ] {
        assert_eq!(canon(&doc).ok().as_deref(), Some(doc.as_str()));
    }
    // Two siblings each reaching the limit: after the first closes, the
    // second may go exactly as deep again, and no deeper.
    let arrays = |n| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let objects = |n| format!("{}0{}", r#"{"a":"#.repeat(n), "}".repeat(n));
    let at_limit = [
        format!("[{},{}]", arrays(126), arrays(126)),
        format!("[{},{}]", objects(126), objects(126)),
        format!(r#"{{"a":{},"b":{}}}"#, objects(126), arrays(126)),
        format!(r#"{{"a":{},"b":{}}}"#, arrays(126), objects(126)),
    ];
    for doc in &at_limit {
        assert_eq!(canon(doc).ok().as_deref(), Some(doc.as_str()));
    }
    assert_eq!(
        refusal(&format!("[{},{}]", arrays(126), arrays(127))),
        "nested too deep at byte 380"
    );
    assert_eq!(
        refusal(&format!(r#"{{"a":{},"b":{}}}"#, objects(126), objects(127))),
        // `{"a":`, 126 objects (`{"a":` and `}` each, and the `0`), `,"b":`,
        // then 126 `{"a":` before the refused one.
        format!(
            "nested too deep at byte {}",
            5 + (126 * 6 + 1) + 5 + 126 * 5
        ),
    );
}

#[test]
fn each_container_closes_with_its_own_bracket() {
    // Containers are kept on a stack, not in the call stack: the bracket
    // that closes one must be its own, at every depth.
    for (input, why) in [
        ("[1}", "expected `,` or `]` at byte 2"),
        ("[}", "expected a value at byte 1"),
        (r#"{"a":1]"#, "expected `,` or `}` at byte 6"),
        (r#"{"a":[1}}"#, "expected `,` or `]` at byte 7"),
        (r#"[{"a":1]]"#, "expected `,` or `}` at byte 7"),
        (r#"[[],{"b":{}]]"#, "expected `,` or `}` at byte 11"),
        ("[[1]", "expected `,` or `]` at byte 4"),
        (r#"{"a":{"b":1}"#, "expected `,` or `}` at byte 12"),
    ] {
        assert_eq!(refusal(input), why, "{input:?}");
    }
    assert_spellings(&[
        (r#"[{"b":[1],"a":{}},[{}]]"#, r#"[{"a":{},"b":[1]},[{}]]"#),
        (
            r#"{"b":[{"d":1,"c":[]}],"a":[]}"#,
            r#"{"a":[],"b":[{"c":[],"d":1}]}"#,
        ),
    ]);
}

#[test]
fn control_characters_and_spaces_in_strings() {
    for b in 0u8..0x20 {
        let named = match b {
            0x08 => "\\b".to_owned(),
            0x09 => "\\t".to_owned(),
            0x0a => "\\n".to_owned(),
            0x0c => "\\f".to_owned(),
            0x0d => "\\r".to_owned(),
            _ => format!("\\u{b:04x}"),
        };
        let want = format!("\"{named}\"");
        for input in [format!("\"\\u{b:04x}\""), format!("\"\\u{b:04X}\"")] {
            assert_eq!(canon(&input).ok(), Some(want.clone()), "{input:?}");
        }
        // Raw, a control character is refused where it stands.
        assert_eq!(
            refusal(&format!("\"a{}\"", char::from(b))),
            "control character in a string at byte 2"
        );
    }
    assert_spellings(&[
        // The first character that is not a control one is written as is.
        (r#""\u0020""#, r#"" ""#),
        (r#""a b""#, r#""a b""#),
        (r#"" ""#, r#"" ""#),
        (r#""\u0021\u007e\u007F""#, "\"!~\u{7f}\""),
        (r#""\/\"\\""#, r#""/\"\\""#),
    ]);
}

#[test]
fn unicode_escapes_and_surrogate_pairs() {
    assert_spellings(&[
        (r#""\ud83d\ude00""#, "\"\u{1f600}\""),
        (r#""\uD83D\uDE00""#, "\"\u{1f600}\""),
        (r#""\uD83d\udE00""#, "\"\u{1f600}\""),
        (r#""\ud800\udc00""#, "\"\u{10000}\""),
        (r#""\udbff\udfff""#, "\"\u{10ffff}\""),
        (r#""\ud801\udc37""#, "\"\u{10437}\""),
        (r#""\ud852\udf62""#, "\"\u{24b62}\""),
        (
            r#""x\ud83d\ude00y\ud83d\ude01""#,
            "\"x\u{1f600}y\u{1f601}\"",
        ),
        (r#""\u00e9\u00E9\u00c9""#, "\"\u{e9}\u{e9}\u{c9}\""),
        (r#""\uabcd\uABCD\uAbCd""#, "\"\u{abcd}\u{abcd}\u{abcd}\""),
        (
            r#""\u0123\u4567\u89ab\ucdef""#,
            "\"\u{123}\u{4567}\u{89ab}\u{cdef}\"",
        ),
        (r#""\uFFFF\ud7ff\ue000""#, "\"\u{ffff}\u{d7ff}\u{e000}\""),
        (
            r#""\u00A0\u00a1\u00B2\u00f3""#,
            "\"\u{a0}\u{a1}\u{b2}\u{f3}\"",
        ),
    ]);
    for (input, want) in [
        (r#""\ud800""#, "lone leading surrogate at byte 7"),
        (r#""\udbff x""#, "lone leading surrogate at byte 7"),
        (r#""\ud83d\u0041""#, "lone leading surrogate at byte 13"),
        (r#""\ud83d\ud83d""#, "lone leading surrogate at byte 13"),
        (r#""\ud83d\ue000""#, "lone leading surrogate at byte 13"),
        (r#""\ud83d\n""#, "lone leading surrogate at byte 7"),
        (r#""\udc00""#, "lone trailing surrogate at byte 7"),
        (r#""\udfff\ud800""#, "lone trailing surrogate at byte 7"),
        (r#""\ude00\ud83d""#, "lone trailing surrogate at byte 7"),
        (r#""\u12""#, "short \\u escape at byte 3"),
        (r#""\u12g4""#, "invalid \\u escape at byte 3"),
        (r#""\u"#, "short \\u escape at byte 3"),
        (r#""\ud83d\ude0"#, "short \\u escape at byte 9"),
        (r#""\x""#, "invalid escape at byte 3"),
    ] {
        assert_eq!(refusal(input), want, "{input:?}");
    }
}

#[test]
fn numbers_in_their_shortest_spelling() {
    assert_spellings(&[
        ("0", "0"),
        ("-0", "0"),
        ("-0.0", "0"),
        ("0e5", "0"),
        ("-0.0e-3", "0"),
        ("1.0", "1"),
        ("-1.0", "-1"),
        ("1e2", "100"),
        ("1E2", "100"),
        ("1e+2", "100"),
        ("1.5e3", "1500"),
        ("-1.5E-3", "-0.0015"),
        ("2.5e0", "2.5"),
        ("12.50", "12.5"),
        ("12.5", "12.5"),
        ("-12.5", "-12.5"),
        ("0.1", "0.1"),
        ("0.000001", "0.000001"),
        ("0.0000012345", "0.0000012345"),
        ("4.35e-5", "0.0000435"),
        ("0.0000001", "1e-7"),
        ("1e-7", "1e-7"),
        ("5e-324", "5e-324"),
        ("1e20", "100000000000000000000"),
        ("1e21", "1e+21"),
        ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ("0.1234567890123456", "0.1234567890123456"),
        ("123456789012.3456", "123456789012.3456"),
        ("9223372036854775807", "9223372036854775807"),
        ("-9223372036854775808", "-9223372036854775808"),
        ("18446744073709551615", "18446744073709551615"),
    ]);
    for (input, want) in [
        ("1e400", "number out of range at byte 5"),
        ("-1e400", "number out of range at byte 6"),
        ("01", "leading zero in a number at byte 1"),
        ("1.", "invalid number at byte 2"),
        ("1e", "invalid number at byte 2"),
        ("1e+", "invalid number at byte 3"),
        ("-", "invalid number at byte 1"),
        ("-a", "invalid number at byte 1"),
    ] {
        assert_eq!(refusal(input), want, "{input:?}");
    }
}

#[test]
fn numbers_keep_their_exact_value() {
    // More significant digits than a double holds: every digit kept, in
    // the same layout (plain up to 21 integer digits, an exponent past).
    assert_spellings(&[
        ("9.000000000000001", "9.000000000000001"),
        ("9.0000000000000010", "9.000000000000001"),
        ("1.00000000000000001", "1.00000000000000001"),
        ("0.0010000000000000001", "0.0010000000000000001"),
        ("0.12345678901234567", "0.12345678901234567"),
        (
            "0.1000000000000000055511151231257827",
            "0.1000000000000000055511151231257827",
        ),
        ("-9223372036854775809", "-9223372036854775809"),
        ("18446744073709551616", "18446744073709551616"),
        ("123456789012345678901", "123456789012345678901"),
        ("-123456789012345678901", "-123456789012345678901"),
        ("1234567890123456789012", "1.234567890123456789012e+21"),
        ("-12345678901234567890123", "-1.2345678901234567890123e+22"),
        ("1000000000000000000000000", "1e+24"),
        ("12345678901234567890123e-2", "123456789012345678901.23"),
        ("12345678901234567890.5", "12345678901234567890.5"),
        ("9007199254740993.0", "9007199254740993"),
        ("900719925474099.30", "900719925474099.3"),
        ("9007199254740993e0", "9007199254740993"),
        ("90071992547409930e-1", "9007199254740993"),
        ("0.0000012345678901234567890", "0.000001234567890123456789"),
        ("0.00000012345678901234567", "1.2345678901234567e-7"),
        ("-1.2345678901234567890e-10", "-1.234567890123456789e-10"),
        (
            "1234567890123456789012345678901234567890e-40",
            "0.123456789012345678901234567890123456789",
        ),
        ("1e-400", "1e-400"),
        ("-25e-401", "-2.5e-400"),
        ("0.000e-99999999999999999999", "0"),
        ("1.7976931348623158e308", "1.7976931348623158e+308"),
        ("1234567890123456789012.5", "1.2345678901234567890125e+21"),
        ("123456789012345678901.5", "123456789012345678901.5"),
    ]);
    // Past the double range by its digits alone.
    let huge = format!("1{}", "0".repeat(309));
    assert_eq!(refusal(&huge), "number out of range at byte 310");
    // Amounts that a double cannot tell apart are different requests.
    for (a, b) in [
        ("9.000000000000001", "9.000000000000002"),
        ("900719925474099.3", "900719925474099.2"),
        ("18446744073709551616", "18446744073709551617"),
        ("1000000000000000000000001", "1000000000000000000000002"),
        ("1e-400", "2e-400"),
    ] {
        assert_ne!(canon(a).ok(), canon(b).ok(), "{a} and {b}");
    }
    // Each spelling is its own canonical form.
    for n in [
        "1.2345678901234567890123e+22",
        "1e-400",
        "0.12345678901234567",
    ] {
        assert_spellings(&[(n, n)]);
    }
    assert_eq!(
        refusal("1e-99999999999999999999"),
        "number out of range at byte 23"
    );
    // Below 10 to the -2^63 refused, by value whatever the spelling: the
    // exponent written must read back.
    let tiny = "1e-9223372036854775807";
    assert_spellings(&[(tiny, tiny), ("10e-9223372036854775808", tiny)]);
    assert_spellings(&[("-0.1e-9223372036854775806", "-1e-9223372036854775807")]);
    for below in [
        "1e-9223372036854775808",
        "0.1e-9223372036854775807",
        "0.000001e-9223372036854775803",
    ] {
        assert!(refusal(below).starts_with("number out of range"), "{below}");
    }
    // Every spelling of a value, the same: a zero more in the fraction,
    // an exponent of zero, the point moved into the exponent.
    for (input, want) in [
        ("9.000000000000001", "9.000000000000001"),
        ("0.00000012345678901234567", "1.2345678901234567e-7"),
        ("12345678901234567890123e-2", "123456789012345678901.23"),
        ("-1.2345678901234567890e-10", "-1.234567890123456789e-10"),
        ("1e-400", "1e-400"),
        ("0.1", "0.1"),
        ("1e21", "1e+21"),
    ] {
        for other in respellings(input) {
            assert_eq!(canon(&other).ok().as_deref(), Some(want), "{other}");
        }
    }
    assert_eq!(
        refusal("[-0.5e99999999999999999999]"),
        "number out of range at byte 26"
    );
}

/// Other spellings of the number `n`'s value.
fn respellings(n: &str) -> Vec<String> {
    let (mantissa, e) = match n.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i128>().unwrap_or_default()),
        None => (n, 0),
    };
    let (sign, unsigned) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let (int, fraction) = unsigned.split_once('.').unwrap_or((unsigned, ""));
    let mut all = vec![
        format!("{sign}{int}.{fraction}0e{e}"),
        format!(
            "{sign}{int}{}{fraction}E{e:+}",
            if fraction.is_empty() { "" } else { "." }
        ),
    ];
    let digits = format!("{int}{fraction}");
    let digits = digits.trim_start_matches('0');
    if !digits.is_empty() {
        all.push(format!("{sign}{digits}e{}", e - fraction.len() as i128));
        all.push(format!(
            "{sign}0.{digits}00e{}",
            e - fraction.len() as i128 + digits.len() as i128
        ));
    }
    all
}

#[test]
fn object_members_sorted_and_duplicate_keys_refused() {
    assert_spellings(&[
        ("{}", "{}"),
        ("{ }", "{}"),
        ("[ ]", "[]"),
        (r#"{"c":3,"b":2,"a":1}"#, r#"{"a":1,"b":2,"c":3}"#),
        // Keys sharing their first eight bytes and more.
        (
            r#"{"abcdefghij":1,"abcdefghi":2,"abcdefghia":3,"abcdefgh":4}"#,
            r#"{"abcdefgh":4,"abcdefghi":2,"abcdefghia":3,"abcdefghij":1}"#,
        ),
        // Sorted by the canonical key's bytes: `\n` before `\u0001`.
        (r#"{"\u0001":1,"\n":2}"#, r#"{"\n":2,"\u0001":1}"#),
        (r#"{"é":1,"z":2,"😀":3}"#, r#"{"z":2,"é":1,"😀":3}"#),
        // Objects inside arrays and objects, each sorted on its own.
        (
            r#"[{"b":1,"a":2},{"d":[{"f":1,"e":2}],"c":3},{"x":{}}]"#,
            r#"[{"a":2,"b":1},{"c":3,"d":[{"e":2,"f":1}]},{"x":{}}]"#,
        ),
        (
            r#"{"z":{"y":{"x":1,"w":2},"v":[3,{"u":4,"t":5}]},"a":[{"c":1,"b":2}]}"#,
            r#"{"a":[{"b":2,"c":1}],"z":{"v":[3,{"t":5,"u":4}],"y":{"w":2,"x":1}}}"#,
        ),
        // The same key in two objects is no duplicate.
        (
            r#"{"b":{"k":1},"a":{"k":3}}"#,
            r#"{"a":{"k":3},"b":{"k":1}}"#,
        ),
    ]);
    // A key twice: which one the upstream reads is its parser's choice
    // (the first, the last, or a refusal), so no spelling stands for the
    // request. Refused where the object ends, keys compared as the strings
    // they denote.
    for (input, at) in [
        (r#"{"a":1,"a":2}"#, 12),
        (r#"{"a":1,"a":1}"#, 12),
        (r#"{"a":1,"b":2,"a":3}"#, 18),
        (r#"{"b":1,"a":2,"b":3}"#, 18),
        (r#"{"a":1,"a":2,"a":3}"#, 18),
        (r#"{"b":1,"b":2,"a":3,"a":4}"#, 24),
        (r#"{"\u0041":1,"A":2}"#, 17),
        (r#"{"A":1,"\u0041":2}"#, 17),
        (r#"{ "a" : 1 , "a" : 2 }"#, 20),
        (r#"{"abcdefghiz":1,"abcdefghia":2,"abcdefghiz":3}"#, 45),
        (r#"{"abcdefghij":1,"abcdefghij":2}"#, 30),
        (r#"[{"k":1},{"k":2,"k":3}]"#, 21),
        (r#"{"b":{"k":1,"k":2},"a":{"k":3}}"#, 17),
        (r#"{"b":{"k":1},"a":{"k":3},"b":{"k":5}}"#, 36),
    ] {
        assert_eq!(
            refusal(input),
            format!("{DUPLICATE_KEY} at byte {at}"),
            "{input:?}"
        );
        assert_eq!(duplicate_keys(input.as_bytes()), Some(true), "{input:?}");
    }
    for (input, want) in [
        (r#"{"a":1,}"#, "expected a key at byte 7"),
        (r#"{"a" 1}"#, "expected `:` at byte 5"),
        (r#"{"a":1 "b":2}"#, "expected `,` or `}` at byte 7"),
        ("[1 2]", "expected `,` or `]` at byte 3"),
        ("[1] 2", "trailing characters at byte 4"),
    ] {
        assert_eq!(refusal(input), want, "{input:?}");
    }
}

#[test]
fn runs_written_where_they_break() {
    // Each spelling changed in the middle of a run that is canonical as it
    // stands: what comes before and after is kept exactly.
    assert_spellings(&[
        (r#"["x",1.0,"y"]"#, r#"["x",1,"y"]"#),
        (r#"["x",-0,"y"]"#, r#"["x",0,"y"]"#),
        (r#"["x","a\/b","y"]"#, r#"["x","a/b","y"]"#),
        (r#"["x","\u0041\u00e9","y"]"#, "[\"x\",\"A\u{e9}\",\"y\"]"),
        (r#"["x","\n\"\\\t","y"]"#, r#"["x","\n\"\\\t","y"]"#),
        ("[\"x\", 1 ,\n\"y\"\t]", r#"["x",1,"y"]"#),
        (r#"[1e2,2E0,"z"]"#, r#"[100,2,"z"]"#),
        ("  \"a\"  ", r#""a""#),
    ]);
}

#[test]
fn unsorted_objects_whether_read_as_they_stand_or_respelled() {
    assert_spellings(&[
        // Compact, the members written from the input.
        (r#"[0,{"b":1,"a":2},3]"#, r#"[0,{"a":2,"b":1},3]"#),
        (
            r#"{"d":1,"c":2,"b":3,"a":4}"#,
            r#"{"a":4,"b":3,"c":2,"d":1}"#,
        ),
        // A key respelled: the members come from the output.
        (r#"{"\u0062":1,"a":2}"#, r#"{"a":2,"b":1}"#),
        (r#"{"b":1,"\u0061":2}"#, r#"{"a":2,"b":1}"#),
        (r#"{"b":1.0,"a":2}"#, r#"{"a":2,"b":1}"#),
        // Whitespace between the members.
        (r#"{"b":1, "a":2}"#, r#"{"a":2,"b":1}"#),
        (r#"{"b":1,"a":2 }"#, r#"{"a":2,"b":1}"#),
        // The members after those that move stay where they stand.
        (
            r#"{"b":{"y":1,"x":2},"a":1,"c":{"z":1}}"#,
            r#"{"a":1,"b":{"x":2,"y":1},"c":{"z":1}}"#,
        ),
        (
            r#"{ "b":1, "a":2, "c":3, "d":[4] }"#,
            r#"{"a":2,"b":1,"c":3,"d":[4]}"#,
        ),
        (
            r#"{"c":1, "b":2, "a":3, "d":4}"#,
            r#"{"a":3,"b":2,"c":1,"d":4}"#,
        ),
        // None stays: the last moves too.
        (r#"{"a":1, "c":2, "b":3}"#, r#"{"a":1,"b":3,"c":2}"#),
        // Keys that tie on their first eight bytes, in order and not.
        (
            r#"{"customer_id":1,"customer_name":2}"#,
            r#"{"customer_id":1,"customer_name":2}"#,
        ),
        (
            r#"{"customer_name":1,"customer_id":2}"#,
            r#"{"customer_id":2,"customer_name":1}"#,
        ),
        // Keys near the end of the input, shorter than eight bytes.
        (r#"{"b":0,"a":0}"#, r#"{"a":0,"b":0}"#),
    ]);
    // A key twice, read as it stands or respelled, among few members or
    // more than the small sort takes: refused.
    let mut twice: Vec<String> = (0..20).rev().map(|n| format!(r#""k{n:02}":{n}"#)).collect();
    twice.push(r#""k07":"again""#.to_owned());
    for doc in [
        r#"{"b":1, "a":2, "b":3, "c":4}"#.to_owned(),
        r#"{"b":1.0,"a":2,"\u0062":3}"#.to_owned(),
        format!("{{{}}}", twice.join(",")),
        format!("[{{{}}}]", twice.join(", ")),
    ] {
        assert!(refusal(&doc).starts_with(DUPLICATE_KEY), "{doc}");
    }
    // More members than the small sort takes.
    let many: Vec<String> = (0..40).rev().map(|n| format!(r#""k{n:02}":{n}"#)).collect();
    let mut sorted = many.clone();
    sorted.sort();
    assert_spellings(&[(
        &format!("{{{}}}", many.join(",")),
        &format!("{{{}}}", sorted.join(",")),
    )]);
}

#[test]
fn strings_a_word_at_a_time_and_at_the_end() {
    let long = "abcdefghijklmnopqrstuvwxyz0123456789";
    for text in [
        String::new(),
        "a".into(),
        long.into(),
        format!("{long}\u{7f}{long}"),
        "\u{7f}".into(),
        format!("{long}é"),
        format!("é{long}"),
        format!("{}😀{}", &long[..7], &long[..9]),
        format!("{}\u{800}\u{ffff}", &long[..5]),
    ] {
        let doc = format!("\"{text}\"");
        assert_eq!(canon(&doc).ok().as_deref(), Some(doc.as_str()), "{doc:?}");
        assert_eq!(
            canon(&doc).ok().map(String::into_bytes),
            reference(doc.as_bytes())
        );
    }
    // Invalid UTF-8, at the start of a word, inside one and at the end.
    for bad in [
        &b"\xc0\x80"[..],
        b"\xed\xa0\x80",
        b"\xe2\x82",
        b"\xf5\x80\x80\x80",
        b"\x80",
        b"\xf0\x9f\x98",
        b"\xe0\x80\xaf",
    ] {
        for (before, after) in [("", ""), ("abcdefghij", ""), ("abc", "defghijklmn")] {
            let mut doc = b"\"".to_vec();
            doc.extend_from_slice(before.as_bytes());
            doc.extend_from_slice(bad);
            doc.extend_from_slice(after.as_bytes());
            doc.push(b'"');
            assert!(
                canonicalize(&doc, &mut Vec::new()).is_err(),
                "{doc:?} accepted"
            );
            assert_eq!(reference(&doc), None);
        }
    }
    // A control character or quote found inside a word, not only at its
    // start, and in the bytes after the last whole word.
    assert_eq!(
        refusal("\"abcdefghij\u{1}klm\""),
        "control character in a string at byte 11"
    );
    for b in [0u8, 0x1f, b'\n'] {
        let inside = format!("\"abc{}defghijklmnopqrstuvwxyz\"", char::from(b));
        assert_eq!(
            refusal(&inside),
            "control character in a string at byte 4",
            "{inside:?}"
        );
    }
    assert_spellings(&[(r#"["abcdefghij","k"]"#, r#"["abcdefghij","k"]"#)]);
}

#[test]
fn a_refused_body_leaves_nothing_for_the_next() {
    // The parser's buffers are kept by the thread between bodies.
    assert!(canon(r#"{"b":{"d":1,"c":2,"#).is_err());
    assert!(canon(r#"{"z":1,"y":[{"x":1,"w":"#).is_err());
    assert_spellings(&[(r#"{"b":1,"a":2}"#, r#"{"a":2,"b":1}"#)]);
    let big = format!(
        "[{}]",
        (0..5000)
            .map(|n| format!(r#"{{"b":{n},"a":"{}"}}"#, "x".repeat(300)))
            .collect::<Vec<_>>()
            .join(",")
    );
    assert!(canon(&big).is_ok());
    assert_spellings(&[(r#"{"d":1,"c":2}"#, r#"{"c":2,"d":1}"#)]);
}

#[test]
fn pieces_of_every_length_copied_whole_near_the_end_and_not() {
    // Members and runs are copied as blocks of 16 or 32 bytes where the
    // input has that many left, else byte for byte: every length around
    // those sizes, with the piece far from the input's end, or its last.
    for len in 0..=40 {
        let text = "abcdefghijklmnopqrstuvwxyz0123456789ABCD"
            .get(..len)
            .unwrap_or_default();
        let tail = " ".repeat(40);
        for doc in [
            // Members reordered, written from the input.
            format!(r#"{{"b":"{text}","a":"{text}"}}"#),
            format!(r#"[{{"b":"{text}","a":"{text}"}},"{tail}"]"#),
            // Members reordered, written from the output (a respelled
            // number breaks the run first).
            format!(r#"{{"b":"{text}","a":1.0,"c":"{text}","a0":2}}"#),
            format!(r#"[{{"b":"{text}","a":1.0,"c":"{text}","a0":2}},"{tail}"]"#),
            // A run broken by whitespace, and the last one at the end.
            format!(r#"["{text}", "{text}" ]"#),
            format!(r#"["{text}", "{text}","{tail}"]"#),
        ] {
            let want = reference(doc.as_bytes()).map(String::from_utf8);
            assert_eq!(canon(&doc).ok(), want.and_then(Result::ok), "{doc}");
        }
    }
}

#[test]
fn objects_of_one_shape_in_a_row_each_sorted() {
    // The order of a small object whose keys' prefixes all differ is kept
    // for the next object with the same prefixes: it must never be applied
    // to one whose keys differ where the prefixes cannot see, nor whose
    // prefixes are fewer, more, tied or in another order.
    for doc in [
        r#"[{"b":1,"a":2},{"b":3,"a":4},{"b":5,"a":6}]"#,
        r#"[{"b":1,"a":2},{"a":3,"b":4},{"b":5,"a":6}]"#,
        r#"[{"b":1,"a":2},{"b":3,"a":4,"c":5},{"c":6,"b":7,"a":8}]"#,
        r#"[{"c":1,"b":2,"a":3},{"c":1,"b":2},{"b":2,"c":1,"a":0}]"#,
        r#"[{"bbbbbbbbX":1,"aaaaaaaaX":2},{"bbbbbbbbY":3,"aaaaaaaaZ":4}]"#,
        r#"[{"key_b_1":1,"key_a_1":2},{"key_b_2":3,"key_a_2":4}]"#,
        r#"[{"key_bbbb2":1,"key_bbbb1":2},{"key_bbbb1":3,"key_bbbb2":4}]"#,
        r#"[{"b":1,"a":2},{"b":3,"a":4,"a":5},{"b":6,"b":7}]"#,
        r#"[{"b":1,"a":2,"a":3},{"b":4,"a":5,"a":6}]"#,
        r#"[{"key_bbbb1":1,"key_bbbb2":2,"a":0},{"key_bbbb2":3,"key_bbbb1":4,"a":0}]"#,
        r#"[{"b":{"d":1,"c":2},"a":{"d":3,"c":4}},{"b":{"d":5,"c":6},"a":[]}]"#,
        r#"[{"b":1,"a":2.0},{"b":3,"a":4.0}, {"b" : 5, "a" : 6}]"#,
    ] {
        let want = reference(doc.as_bytes()).map(String::from_utf8);
        assert_eq!(canon(doc).ok(), want.and_then(Result::ok), "{doc}");
    }
}

#[test]
fn keys_about_a_word_long_in_every_order() {
    // Keys of up to seven plain bytes are read with their closing quote
    // from one eight-byte word, longer ones (or ones with an escape or
    // other text) by the general path: keys either side of that length,
    // sharing their first bytes, must still order and compare as their
    // bytes do, wherever the input ends.
    let keys = [
        "abcdef",
        "abcdefg",
        "abcdefgh",
        "abcdefga",
        "abcdefg\\u0041",
        "abcdefé",
        "",
    ];
    let mut rng = Lcg(7);
    for round in 0..200 {
        let mut members: Vec<String> = keys
            .iter()
            .enumerate()
            .map(|(n, k)| format!(r#""{k}":{n}"#))
            .collect();
        for n in (1..members.len()).rev() {
            members.swap(n, rng.below(n + 1));
        }
        members.truncate(1 + round % keys.len());
        // With and without a repeated key, and objects that end the input.
        if round % 3 == 0 {
            let again = members[0].replace(':', ":9");
            members.push(again);
        }
        for doc in [
            format!("{{{}}}", members.join(",")),
            format!("[{{{}}},1]", members.join(",")),
        ] {
            let want = reference(doc.as_bytes()).map(String::from_utf8);
            assert_eq!(canon(&doc).ok(), want.and_then(Result::ok), "{doc}");
        }
    }
}

#[test]
fn objects_written_before_they_close_are_reordered_with_their_ends() {
    // An object whose members were written out before its `}` (an inner
    // object reordered, whitespace dropped, a number or an escape
    // respelled) is rewritten from the output, each member ending before
    // the comma ahead of the next key, the last at the `}`.
    for (input, want) in [
        (
            r#"{ "abcdefg" :1.0 , "abcdef":{"b":1,"a":2} ,"abcdefga":[{"y":"\u0041","x":[]}],"":{} }"#,
            r#"{"":{},"abcdef":{"a":2,"b":1},"abcdefg":1,"abcdefga":[{"x":[],"y":"A"}]}"#,
        ),
        (
            r#"{"abcdefg":[1.0],"abcdef":1,"abcdefgh":2}"#,
            r#"{"abcdef":1,"abcdefg":[1],"abcdefgh":2}"#,
        ),
        (
            r#"{"c":{"d":1,"c":2} , "a":[ ],"b":{"f":1.50,"e":2}}"#,
            r#"{"a":[],"b":{"e":2,"f":1.5},"c":{"c":2,"d":1}}"#,
        ),
    ] {
        assert_eq!(canon(input).ok().as_deref(), Some(want), "{input}");
        assert_eq!(
            reference(input.as_bytes()).map(String::from_utf8),
            Some(Ok(want.to_owned())),
            "{input}"
        );
    }
}

#[test]
fn a_short_key_read_from_one_word_has_the_prefix_of_its_bytes() {
    fn parser(s: &[u8]) -> Parser<'_> {
        Parser {
            s,
            i: 0,
            run: 0,
            frames: Vec::new(),
            members: Vec::new(),
            scratch: Vec::new(),
            order: Vec::new(),
            shape: Shape::NONE,
            refusal: Fault { what: "", at: 0 },
        }
    }
    for key in ["", "a", "ab", "abc", "abcdefg", "z~ }{z!"] {
        let input = format!(r#""{key}":[1,2,3,4,5,6,7,8]"#);
        let mut p = parser(input.as_bytes());
        let len = key.len() + 1;
        assert_eq!(
            p.short_key(),
            Some(key_prefix(input.as_bytes(), 1, len)),
            "{key}"
        );
        assert_eq!(p.i, 1 + len, "{key}: stands after its closing quote");
    }
    // Stops after the closing quote in the same word are masked off.
    let input = "\"a\":\"é\\\"x\"";
    let mut p = parser(input.as_bytes());
    assert_eq!(p.short_key(), Some(key_prefix(input.as_bytes(), 1, 2)));
    assert_eq!(p.i, 3);
    // Not read this way (nothing stepped over): eight bytes or more, an
    // escape, a byte that is not ASCII, a control character, fewer than
    // eight bytes left.
    for input in [
        r#""abcdefgh":1,2,3,4"#,
        r#""ab\"c":1,2,3,4,5"#,
        "\"abé\":1,2,3,4,5",
        "\"a\u{1}\":1,2,3,4",
        r#""a":1}"#,
    ] {
        let mut p = parser(input.as_bytes());
        assert_eq!(p.short_key(), None, "{input}");
        assert_eq!(p.i, 0, "{input}");
    }
}
