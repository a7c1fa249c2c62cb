//! Parsing the `Idempotency-Key` header.
//!
//! The IETF draft (`draft-ietf-httpapi-idempotency-key-header`) defines the
//! header as a Structured Field string (`"abc"`); Stripe and most client
//! libraries send the bare value (`abc`). Both spell the same key.

use std::fmt;

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// The longest scope accepted, in bytes: what every store keeps beside a
/// key of [`MAX_KEY_LEN`] (MySQL's column holds 2,048 bytes; PostgreSQL's
/// index entry, scope and key together, about 2,700). The edges refuse a
/// request whose scope is longer (`401 scope-missing`, gRPC
/// `UNAUTHENTICATED`), and runs a longer scope, rather than have the store
/// fail on it every time.
pub const MAX_SCOPE_LEN: usize = 1024;

/// The name of the header that carries the key (RFC 9110 names are
/// case-insensitive; this is the lower-case spelling HTTP/2 requires).
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] characters of visible
/// ASCII (0x21 to 0x7E).
///
/// ```
/// use idem_core::IdempotencyKey;
///
/// let bare = IdempotencyKey::parse(b"order-42").unwrap();
/// let quoted = IdempotencyKey::parse(br#""order-42""#).unwrap();
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-42");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

/// Why an `Idempotency-Key` header was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// No `Idempotency-Key` header was sent.
    #[error("the Idempotency-Key header is missing")]
    Missing,
    /// The header was sent more than once.
    #[error("the Idempotency-Key header was sent {count} times; send it once")]
    Repeated {
        /// How many times it was sent.
        count: usize,
    },
    /// The header (or the string inside its quotes) is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    #[error("the Idempotency-Key is {len} characters long; the limit is {MAX_KEY_LEN}")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
    },
    /// The key holds a byte outside visible ASCII (0x21 to 0x7E).
    #[error("the Idempotency-Key holds byte 0x{byte:02x} at position {position}; only visible ASCII (0x21 to 0x7E) is allowed")]
    InvalidCharacter {
        /// The offending byte.
        byte: u8,
        /// Its position in the (unquoted) key.
        position: usize,
    },
    /// The value starts with `"` but is not a valid Structured Field string.
    #[error("the Idempotency-Key is not a valid Structured Field string: {reason}")]
    MalformedString {
        /// What the Structured Field parser said.
        reason: String,
    },
}

impl IdempotencyKey {
    /// Parses one header value, in either the Structured Field string form
    /// (`"abc"`, with `\"` and `\\` escapes) or the bare form (`abc`).
    ///
    /// Surrounding spaces and tabs (optional whitespace in HTTP) are ignored.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        if value.first() == Some(&b'"') {
            let item = sfv::Parser::parse_item(value).map_err(|e| KeyError::MalformedString {
                reason: e.to_string(),
            })?;
            if !item.params.is_empty() {
                return Err(KeyError::MalformedString {
                    reason: "parameters are not allowed on the key".to_owned(),
                });
            }
            match item.bare_item {
                sfv::BareItem::String(s) => Self::validate(s.into_bytes()),
                _ => Err(KeyError::MalformedString {
                    reason: "expected a string".to_owned(),
                }),
            }
        } else {
            Self::validate(value.to_vec())
        }
    }

    /// Parses the values of every `Idempotency-Key` header of a request.
    ///
    /// No value is [`KeyError::Missing`]; more than one is
    /// [`KeyError::Repeated`], even when they agree, because a proxy or
    /// client that doubles the header has a bug worth surfacing.
    pub fn from_header_values<'a, I>(values: I) -> Result<Self, KeyError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let mut iter = values.into_iter();
        let first = iter.next().ok_or(KeyError::Missing)?;
        let extra = iter.count();
        if extra > 0 {
            return Err(KeyError::Repeated { count: extra + 1 });
        }
        Self::parse(first)
    }

    fn validate(bytes: Vec<u8>) -> Result<Self, KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty);
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len() });
        }
        if let Some((position, &byte)) = bytes
            .iter()
            .enumerate()
            .find(|(_, b)| !(0x21..=0x7e).contains(*b))
        {
            return Err(KeyError::InvalidCharacter { byte, position });
        }
        // Every byte is ASCII, so this cannot fail; map the impossible case
        // to an error anyway rather than panic.
        String::from_utf8(bytes)
            .map(Self)
            .map_err(|_| KeyError::Empty)
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Consumes the key, returning its string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_view_of_a_key_is_the_key() {
        let k = IdempotencyKey::parse(b"\"order-42\"").unwrap();
        assert_eq!(k.to_string(), "order-42");
        assert_eq!(AsRef::<str>::as_ref(&k), "order-42");
        assert_eq!(k.into_string(), "order-42");
    }

    #[test]
    fn bare_and_quoted_are_the_same_key() {
        let a = IdempotencyKey::parse(b"abc-123").unwrap();
        let b = IdempotencyKey::parse(b"\"abc-123\"").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.as_str(), "abc-123");
    }

    #[test]
    fn quoted_escapes_are_decoded() {
        let k = IdempotencyKey::parse(br#""a\"b\\c""#).unwrap();
        assert_eq!(k.as_str(), r#"a"b\c"#);
        // the bare spelling of the same key
        assert_eq!(k, IdempotencyKey::parse(br#"a"b\c"#).unwrap());
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(IdempotencyKey::parse(b"  k1\t").unwrap().as_str(), "k1");
    }

    #[test]
    fn empty_is_rejected_in_both_forms() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"   "), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn length_limit_is_255() {
        let ok = vec![b'a'; 255];
        assert_eq!(IdempotencyKey::parse(&ok).unwrap().as_str().len(), 255);
        let long = vec![b'a'; 256];
        assert_eq!(
            IdempotencyKey::parse(&long),
            Err(KeyError::TooLong { len: 256 })
        );
        let mut quoted = vec![b'"'];
        quoted.extend_from_slice(&long);
        quoted.push(b'"');
        assert_eq!(
            IdempotencyKey::parse(&quoted),
            Err(KeyError::TooLong { len: 256 })
        );
    }

    #[test]
    fn only_visible_ascii() {
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidCharacter {
                byte: b' ',
                position: 1
            })
        );
        assert!(matches!(
            IdempotencyKey::parse("caf\u{e9}".as_bytes()),
            Err(KeyError::InvalidCharacter { position: 3, .. })
        ));
        assert!(matches!(
            IdempotencyKey::parse(b"a\x01"),
            Err(KeyError::InvalidCharacter { byte: 1, .. })
        ));
        // a space inside the quotes is a valid sf-string but not a valid key
        assert!(matches!(
            IdempotencyKey::parse(b"\"a b\""),
            Err(KeyError::InvalidCharacter { byte: b' ', .. })
        ));
        // the whole visible range is fine
        let all: Vec<u8> = (0x21..=0x7e).collect();
        assert!(IdempotencyKey::parse(&all).is_ok());
    }

    #[test]
    fn malformed_structured_strings_are_rejected() {
        for bad in [&b"\"abc"[..], b"\"abc\"x", b"\"a\\qb\"", b"\"abc\";p=1"] {
            assert!(
                matches!(
                    IdempotencyKey::parse(bad),
                    Err(KeyError::MalformedString { .. })
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn header_count_rules() {
        let none: [&[u8]; 0] = [];
        assert_eq!(
            IdempotencyKey::from_header_values(none),
            Err(KeyError::Missing)
        );
        assert_eq!(
            IdempotencyKey::from_header_values([&b"a"[..], b"a"]),
            Err(KeyError::Repeated { count: 2 })
        );
        assert_eq!(
            IdempotencyKey::from_header_values([&b"\"a\""[..]])
                .unwrap()
                .as_str(),
            "a"
        );
    }
}

/// The value of a header (or gRPC metadata entry) that a request must
/// carry exactly once, as a non-empty run of visible ASCII: the rule for
/// the headers an idem scope is read from. Absent, repeated (a client's
/// own value beside the one authentication added must never pick the
/// scope), empty or anything else is `None`.
pub fn single_visible_value<'a, I>(values: I) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a [u8]>,
{
    let mut values = values.into_iter();
    let only = match (values.next(), values.next()) {
        (Some(v), None) => v,
        _ => return None,
    };
    if only.is_empty() || !only.iter().all(u8::is_ascii_graphic) {
        return None;
    }
    std::str::from_utf8(only).ok()
}

#[cfg(test)]
mod single_value_tests {
    use super::single_visible_value;

    #[test]
    fn exactly_one_visible_value() {
        assert_eq!(single_visible_value([&b"acme"[..]]), Some("acme"));
        assert_eq!(single_visible_value(Vec::<&[u8]>::new()), None);
        assert_eq!(single_visible_value([&b"a"[..], &b"a"[..]]), None);
        for bad in [&b""[..], b"a b", b"caf\xc3\xa9", b"a\tb"] {
            assert_eq!(single_visible_value([bad]), None, "{bad:?}");
        }
    }
}
