//! The test oracle for numbers, shared by the unit tests and the
//! `canonical_json` fuzz target (which includes this file by path): a
//! number's exact value read from its spelling with string operations,
//! whether the spelling idem used before changed that value, and where a
//! document's numbers are.

/// The exact value a JSON number's spelling denotes, as its sign, its
/// significant digits and the power of ten just above it (`0.1234e3` for
/// `123.4`); zero as `None`.
pub(crate) fn exact(number: &str) -> Option<(bool, String, i128)> {
    let (negative, rest) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (mantissa, e) = rest.split_once(['e', 'E']).unwrap_or((rest, "0"));
    let (int, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all = format!("{int}{fraction}");
    let significant = all.trim_start_matches('0');
    let digits = significant.trim_end_matches('0');
    if digits.is_empty() {
        return None;
    }
    // An exponent past 128 bits: a value no other spelling here has.
    let Ok(e) = e.parse::<i128>() else {
        return Some((negative, digits.to_owned(), i128::MIN));
    };
    let n = significant.len() as i128 - fraction.len() as i128 + e;
    Some((negative, digits.to_owned(), n))
}

/// Whether a number's spelling denotes a value the old spelling changed
/// (`serde_json` reads it as a double unless it is an integer that fits
/// 64 bits, and `serde_jcs` writes the double's shortest spelling, ties
/// to even as ECMAScript breaks them): the new spelling keeps the value.
pub(crate) fn lossy(number: &str) -> bool {
    let old = serde_json::from_str::<serde_json::Value>(number)
        .ok()
        .and_then(|v| serde_jcs::to_string(&v).ok());
    old.is_some_and(|old| exact(&old) != exact(number))
}

/// Where the numbers of the JSON document `doc` are (the runs outside its
/// strings that start like a number).
pub(crate) fn number_spans(doc: &str) -> Vec<std::ops::Range<usize>> {
    let (mut found, mut in_string, mut escaped, mut start) = (Vec::new(), false, false, None);
    for (at, c) in doc.char_indices().chain([(doc.len(), ' ')]) {
        if in_string {
            (escaped, in_string) = (!escaped && c == '\\', escaped || c != '"');
            continue;
        }
        let part = c.is_ascii_digit() || "+-.eE".contains(c);
        match start {
            None if part && (c == '-' || c.is_ascii_digit()) => start = Some(at),
            Some(from) if !part => {
                found.push(from..at);
                start = None;
            }
            _ => {}
        }
        in_string = c == '"';
    }
    found
}

/// Whether some object of the JSON document `doc` holds a key twice, keys
/// compared as the strings they denote (`"\u0041"` is `"A"`); `None` if
/// `serde_json` does not read `doc`.
pub(crate) fn duplicate_keys(doc: &[u8]) -> Option<bool> {
    use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};

    /// Any JSON value, refused if an object in it holds a key twice.
    struct Unique;

    impl<'de> Deserialize<'de> for Unique {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(Unique)
        }
    }

    impl<'de> Visitor<'de> for Unique {
        type Value = Unique;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, _: bool) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_str<E>(self, _: &str) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_unit<E>(self) -> Result<Unique, E> {
            Ok(Unique)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Unique, A::Error> {
            while seq.next_element::<Unique>()?.is_some() {}
            Ok(Unique)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Unique, A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                if !seen.insert(key) {
                    return Err(A::Error::custom("a key twice"));
                }
                map.next_value::<Unique>()?;
            }
            Ok(Unique)
        }
    }

    serde_json::from_slice::<serde_json::Value>(doc).ok()?;
    Some(serde_json::from_slice::<Unique>(doc).is_err())
}
