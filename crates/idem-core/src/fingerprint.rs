//! Request fingerprints: what makes two requests "the same request".
//!
//! A fingerprint is SHA-256 over the method, the path with its query, and the
//! body. A JSON body (by `Content-Type`) is canonicalised first, after
//! RFC 8785 (JCS): object keys sorted, no insignificant whitespace, numbers
//! and strings in one canonical spelling. The same JSON sent by another client
//! library therefore gets the same fingerprint. A body that claims to be JSON
//! but does not parse (or that [`canonical_json`] refuses) is fingerprinted
//! as raw bytes.
//!
//! Where it departs from RFC 8785 (found by the `canonical_json` fuzz
//! target; stable, so fingerprints stay comparable): keys are sorted by the
//! bytes of their canonical spelling, quotes included (code-point order,
//! but for keys that differ where one has a character below `"` or an
//! escape); a number keeps its exact value, every significant digit,
//! instead of becoming the nearest double (`18446744073709551617` and
//! `1.00000000000000001` stay as they are: two amounts a double cannot
//! tell apart are two requests); an object holding a key twice is refused,
//! so its body is fingerprinted raw. The rules in full are in
//! [`canonical_json`].
//!
//! Numbers changed spelling in December 2026 where a double could not hold
//! their value: before, every number but an integer that fits 64 bits was
//! rounded to the nearest double, so `{"amount":10000000000000000000001}`
//! and `{"amount":10000000000000000000002}` shared a fingerprint and the
//! second replayed the first's answer. A body keeps its fingerprint unless
//! it holds such a number: more significant digits than a double tells
//! apart (`9.000000000000001` was `9.000000000000002`), or below a
//! double's range (`1e-400` was `0`, `4.9e-324` was `5e-324`; and a number
//! below 10 to the −2⁶³ is now refused, so fingerprinted raw). A retry whose
//! first attempt was recorded before the upgrade and whose body holds such
//! a number gets `422` instead of the replay (no effect runs twice).
//!
//! Bodies with a key twice in one object were refused in December 2026
//! too. Before, the last of the two was kept, as `serde_json` keeps it, so
//! `{"amount":1000,"amount":1}` and `{"amount":5,"amount":1}` shared a
//! fingerprint, while a server whose parser keeps the first key (or the
//! same server behind a proxy that does) read them as 1000 and 5: a reused
//! key with a changed amount got the first answer replayed instead of
//! `422`. Such a body is now fingerprinted as its bytes; a retry of one
//! whose first attempt was recorded before the upgrade gets `422`.
//!
//! One spelling changed when the canonicaliser became a single pass: in
//! builds where `serde_json`'s `raw_value` feature was on (axum's `json`
//! feature turns it on), an object whose first key was
//! `$serde_json::private::RawValue` was read as the JSON text held in its
//! value, so `{"$serde_json::private::RawValue":"{\"a\":1}"}` and `{"a":1}`
//! shared a fingerprint. It is now an object like any other, in every build.

use std::fmt;

use sha2::{Digest, Sha256};

/// A SHA-256 request fingerprint.
///
/// ```
/// use idem_core::Fingerprint;
///
/// let a = Fingerprint::of_request("POST", "/payments", Some("application/json"),
///     br#"{"amount": 100, "currency": "EUR"}"#);
/// let b = Fingerprint::of_request("POST", "/payments", Some("application/json; charset=utf-8"),
///     br#"{"currency":"EUR","amount":1e2}"#);
/// assert_eq!(a, b);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

/// How a body entered the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyForm {
    /// Parsed as JSON and canonicalised.
    CanonicalJson,
    /// Taken byte for byte.
    Raw,
}

/// Canonicalising a JSON document failed.
#[derive(Debug, thiserror::Error)]
#[error("not canonicalisable JSON: {0}")]
pub struct CanonicalJsonError(pub(crate) String);

impl Fingerprint {
    /// Fingerprints a request from its parts.
    ///
    /// `path_and_query` is the request target as received (`/a/b?x=1`);
    /// `content_type` is the raw `Content-Type` header, if any.
    pub fn of_request(
        method: &str,
        path_and_query: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Self {
        Self::of_request_with_form(method, path_and_query, content_type, body).0
    }

    /// Like [`Fingerprint::of_request`], also saying how the body was read.
    pub fn of_request_with_form(
        method: &str,
        path_and_query: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> (Self, BodyForm) {
        if !content_type.is_some_and(is_json_media_type) {
            return Self::digest(method, path_and_query, BodyForm::Raw, body);
        }
        crate::canonical::with_canonical(body, |canonical| match canonical {
            Ok(c) => Self::digest(method, path_and_query, BodyForm::CanonicalJson, c),
            Err(_) => Self::digest(method, path_and_query, BodyForm::Raw, body),
        })
    }

    fn digest(method: &str, path_and_query: &str, form: BodyForm, body: &[u8]) -> (Self, BodyForm) {
        let mut h = Sha256::new();
        h.update(b"idem-fingerprint-v1");
        // Length-prefix each field so that no two requests share an encoding.
        for field in [method.as_bytes(), path_and_query.as_bytes()] {
            h.update((field.len() as u64).to_be_bytes());
            h.update(field);
        }
        h.update([match form {
            BodyForm::CanonicalJson => b'j',
            BodyForm::Raw => b'r',
        }]);
        h.update((body.len() as u64).to_be_bytes());
        h.update(body);
        (Self(h.finalize().into()), form)
    }

    /// Builds a fingerprint from its 32 bytes (as read back from a store).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Builds a fingerprint from a slice, which must be 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Self)
    }

    /// The 32 bytes of the digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        self.0.iter().fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Whether a `Content-Type` value names JSON: `application/json` or any
/// `+json` structured syntax suffix, parameters ignored, case-insensitive.
pub fn is_json_media_type(content_type: &str) -> bool {
    // Compared in place, case-insensitively: no lowercased copy per request.
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .as_bytes();
    let Some(subtype) = essence
        .get(..b"application/".len())
        .filter(|ty| ty.eq_ignore_ascii_case(b"application/"))
        .map(|ty| &essence[ty.len()..])
    else {
        return false;
    };
    subtype.eq_ignore_ascii_case(b"json")
        || subtype
            .len()
            .checked_sub(b"+json".len())
            .is_some_and(|at| subtype[at..].eq_ignore_ascii_case(b"+json"))
}

/// Canonicalises a JSON document after RFC 8785 (see the [module
/// docs](self) for where it departs from it), in one pass over the bytes
/// without building a value:
///
/// - no insignificant whitespace;
/// - object members sorted by the bytes of their canonical key, quotes
///   included;
/// - strings with the minimal escapes: `\"`, `\\`, `\b \f \n \r \t`,
///   and `\u00xx` (lowercase) for the other control characters; everything
///   else as UTF-8;
/// - a number keeps its exact value, its significant digits laid out as
///   ECMAScript's `Number.prototype.toString` lays out a double's (`1.0`
///   is `1`, `1e2` is `100`, `1e21` is `1e+21`, `0.0000001` is `1e-7`,
///   `-0` is `0`): where that value is the value of ECMAScript's shortest
///   spelling of the nearest double, that spelling; otherwise every
///   significant digit (`18446744073709551617`, `1.00000000000000001`,
///   `1e-400`).
///
/// Refused, as `serde_json` refuses them: a lone surrogate escape, a raw
/// control character in a string, invalid UTF-8, a number too large for a
/// double, containers nested 128 deep, anything after the value. Refused
/// as well (`serde_json` reads it as zero): a non-zero number so small
/// that its spelling's exponent would not fit 64 bits (below 10 to the
/// −2⁶³); and (`serde_json` keeps the last) an object holding a key twice,
/// keys compared as the strings they denote (`"\u0041"` is `"A"`), since
/// another parser keeps the first. A refused body is fingerprinted as its
/// raw bytes.
///
/// ```
/// let c = idem_core::fingerprint::canonical_json(br#"{ "b": [1.0, "\u0041"], "a": null }"#).unwrap();
/// assert_eq!(c, br#"{"a":null,"b":[1,"A"]}"#);
/// ```
pub fn canonical_json(body: &[u8]) -> Result<Vec<u8>, CanonicalJsonError> {
    let mut out = Vec::with_capacity(body.len());
    crate::canonical::canonicalize(body, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: Option<&str> = Some("application/json");

    #[test]
    fn fingerprints_print_as_their_hex() {
        let f = Fingerprint::of_request("POST", "/p", None, b"x");
        let hex = f.to_hex();
        assert_eq!(hex.len(), 64);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(f.to_string(), hex);
        assert_eq!(format!("{f:?}"), format!("Fingerprint({hex})"));
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = Fingerprint::of_request("POST", "/p", JSON, br#"{"a":1,"b":{"y":2,"x":[1,2]}}"#);
        let b = Fingerprint::of_request(
            "POST",
            "/p",
            JSON,
            b"{\n  \"b\" : { \"x\" : [ 1 , 2 ], \"y\" : 2 },\n  \"a\" : 1\n}\n",
        );
        assert_eq!(a, b);
    }

    #[test]
    fn numbers_and_strings_have_one_spelling() {
        assert_eq!(
            canonical_json(b"[1.0, 1e2, 0.5e1, -0]").unwrap(),
            b"[1,100,5,0]"
        );
        assert_eq!(
            canonical_json(br#""\u00e9\/\u0041""#).unwrap(),
            "\"\u{e9}/A\"".as_bytes()
        );
        assert_eq!(canonical_json(br#""\u001f""#).unwrap(), br#""\u001f""#);
        assert_eq!(canonical_json(b"1e21").unwrap(), b"1e+21");
    }

    #[test]
    fn values_matter() {
        let a = Fingerprint::of_request("POST", "/p", JSON, br#"{"amount":100}"#);
        let b = Fingerprint::of_request("POST", "/p", JSON, br#"{"amount":101}"#);
        assert_ne!(a, b);
    }

    #[test]
    fn a_body_holding_a_key_twice_is_fingerprinted_as_its_bytes() {
        // An upstream whose parser keeps the first of two keys reads these
        // as 1000 and 5; one that keeps the last, as 1 and 1. Neither reading
        // may decide: each body is only the same request as itself.
        let first = br#"{"amount":1000,"amount":1}"#;
        let second = br#"{"amount":5,"amount":1}"#;
        let (f, form) = Fingerprint::of_request_with_form("POST", "/p", JSON, first);
        assert_eq!(form, BodyForm::Raw);
        assert_eq!(f, Fingerprint::of_request("POST", "/p", None, first));
        assert_ne!(f, Fingerprint::of_request("POST", "/p", JSON, second));
        assert_ne!(
            f,
            Fingerprint::of_request("POST", "/p", JSON, br#"{"amount":1}"#)
        );
        assert_ne!(
            Fingerprint::of_request("POST", "/p", JSON, br#"{"a":{"k":1,"k":2}}"#),
            Fingerprint::of_request("POST", "/p", JSON, br#"{"a":{"k":3,"k":2}}"#)
        );
    }

    #[test]
    fn method_path_and_query_matter() {
        let body = br#"{"a":1}"#;
        let base = Fingerprint::of_request("POST", "/p", JSON, body);
        assert_ne!(base, Fingerprint::of_request("PATCH", "/p", JSON, body));
        assert_ne!(base, Fingerprint::of_request("POST", "/q", JSON, body));
        assert_ne!(base, Fingerprint::of_request("POST", "/p?x=1", JSON, body));
    }

    #[test]
    fn json_media_types() {
        assert!(is_json_media_type("application/json"));
        assert!(is_json_media_type("Application/JSON; charset=utf-8"));
        assert!(is_json_media_type("application/merge-patch+json"));
        assert!(!is_json_media_type("text/plain"));
        assert!(!is_json_media_type("application/jsonx"));
    }

    /// The comparison in place answers as the lowercased copy it replaced.
    #[test]
    fn json_media_types_as_the_lowercased_copy_said() {
        fn lowercased(content_type: &str) -> bool {
            let essence = content_type
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            essence == "application/json"
                || (essence.starts_with("application/") && essence.ends_with("+json"))
        }
        let cases = [
            "",
            " ",
            ";",
            "application",
            "application/",
            "APPLICATION/",
            "application/j",
            "application/json",
            " Application/Json ",
            "application/json;",
            "application/JSON ; q=1",
            "application/jsonx",
            "application/json+",
            "application/+json",
            "application/+JSON",
            "application/vnd.api+json",
            "APPLICATION/VND.API+JSON; charset=utf-8",
            "application/json+xml",
            "application+json",
            "text/json",
            "text/x+json",
            "applicatioN/merge-patch+Json",
            "application/ json",
            "application /json",
            "application/\u{e9}+json",
            "\u{e9}pplication/json",
            "application/json\u{e9}",
            "application/\u{2028}json",
            "\u{a0}application/json",
            "application/json\u{2028}",
        ];
        for ct in cases {
            assert_eq!(is_json_media_type(ct), lowercased(ct), "{ct:?}");
        }
    }

    #[test]
    fn non_json_bodies_are_raw() {
        let (a, form) =
            Fingerprint::of_request_with_form("POST", "/p", Some("text/plain"), b"{\"a\":1}");
        assert_eq!(form, BodyForm::Raw);
        let b = Fingerprint::of_request("POST", "/p", Some("text/plain"), b"{ \"a\":1}");
        assert_ne!(a, b, "raw bodies compare byte for byte");
    }

    #[test]
    fn invalid_json_is_fingerprinted_raw() {
        let (a, form) = Fingerprint::of_request_with_form("POST", "/p", JSON, b"{not json");
        assert_eq!(form, BodyForm::Raw);
        let (b, _) =
            Fingerprint::of_request_with_form("POST", "/p", Some("text/plain"), b"{not json");
        // same bytes, same form: same fingerprint whatever the label said
        assert_eq!(a, b);
        assert_ne!(
            a,
            Fingerprint::of_request("POST", "/p", JSON, b"{not  json")
        );
    }

    #[test]
    fn json_and_raw_forms_do_not_collide() {
        let canonical = br#"{"a":1}"#;
        let j = Fingerprint::of_request("POST", "/p", JSON, canonical);
        let r = Fingerprint::of_request("POST", "/p", None, canonical);
        assert_ne!(j, r);
    }

    #[test]
    fn hex_round_trip() {
        let f = Fingerprint::of_request("POST", "/", None, b"");
        assert_eq!(f.to_hex().len(), 64);
        assert_eq!(Fingerprint::from_slice(f.as_bytes()), Some(f));
        assert_eq!(Fingerprint::from_slice(&[0; 3]), None);
    }
}
