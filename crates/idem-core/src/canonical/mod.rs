//! Canonical JSON in one pass over the bytes, without building a value.
//!
//! The spelling is the one idem has always fingerprinted (that of
//! `serde_json` parsing and `serde_jcs` writing; the `canonical_json` fuzz
//! target checks the two agree on every input, errors included), so records
//! written before stay comparable:
//!
//! - no insignificant whitespace;
//! - object members sorted by the bytes of their canonical key, quotes
//!   included; of duplicate keys, the last wins;
//! - strings with the minimal escapes: `\"`, `\\`, `\b \f \n \r \t`, and
//!   `\u00xx` (lowercase) for the other control characters; everything else
//!   as UTF-8;
//! - an integer that fits 64 bits keeps its digits (`-0` is `0`); any other
//!   number is read as the nearest double and written in ECMAScript's
//!   shortest spelling (`1.0` is `1`, `1e2` is `100`), zero as `0`;
//! - what `serde_json` refuses is refused: a lone surrogate escape, a raw
//!   control character in a string, invalid UTF-8, a number beyond the
//!   double range, nesting 128 deep, anything after the value.

use crate::fingerprint::CanonicalJsonError;

/// Containers nested this deep are refused (as `serde_json` does).
const MAX_DEPTH: u32 = 128;

/// Canonicalises `input` into `out` (appended).
pub(crate) fn canonicalize(input: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
    let mut p = Parser {
        s: input,
        i: 0,
        depth: 0,
        members: Vec::new(),
        scratch: Vec::new(),
    };
    p.value(out)?;
    p.skip_ws();
    if p.i != p.s.len() {
        return Err(p.error("trailing characters"));
    }
    Ok(())
}

/// One object member as written to `out`: where its key starts and ends
/// (quotes included) and where its value ends.
#[derive(Clone, Copy)]
struct Member {
    /// The key's first bytes after its opening quote, big-endian and padded
    /// with zeros: ordering by it orders by the key, but for keys that share
    /// these bytes (no key holds a zero byte, nor is one a prefix of
    /// another, for each ends in its closing quote).
    prefix: u64,
    key: usize,
    colon: usize,
    end: usize,
}

impl Member {
    fn new(out: &[u8], key: usize, colon: usize, end: usize) -> Self {
        let after_quote = &out[key + 1..colon];
        let prefix = (0..8).fold(0u64, |p, i| {
            p << 8 | u64::from(after_quote.get(i).copied().unwrap_or(0))
        });
        Self {
            prefix,
            key,
            colon,
            end,
        }
    }

    /// Orders by key; `buf` holds the member at `base`.
    fn cmp(&self, other: &Self, buf: &[u8], base: usize) -> std::cmp::Ordering {
        self.prefix.cmp(&other.prefix).then_with(|| {
            buf[self.key - base..self.colon - base].cmp(&buf[other.key - base..other.colon - base])
        })
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    depth: u32,
    /// The members of the objects being read, innermost last.
    members: Vec<Member>,
    /// Where an unsorted object's members wait while they are reordered.
    scratch: Vec<u8>,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> CanonicalJsonError {
        CanonicalJsonError(format!("{what} at byte {}", self.i))
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn expect(&mut self, byte: u8, what: &str) -> Result<(), CanonicalJsonError> {
        self.skip_ws();
        if self.peek() == Some(byte) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.error(what))
        }
    }

    fn value(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.object(out),
            Some(b'[') => self.array(out),
            Some(b'"') => self.string(out),
            Some(b't') => self.literal(b"true", out),
            Some(b'f') => self.literal(b"false", out),
            Some(b'n') => self.literal(b"null", out),
            Some(b'-' | b'0'..=b'9') => self.number(out),
            Some(_) => Err(self.error("expected a value")),
            None => Err(self.error("unexpected end")),
        }
    }

    fn literal(&mut self, word: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        if self.s[self.i..].starts_with(word) {
            self.i += word.len();
            out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.error("expected a literal"))
        }
    }

    fn enter(&mut self) -> Result<(), CanonicalJsonError> {
        if self.depth + 1 >= MAX_DEPTH {
            return Err(self.error("nested too deep"));
        }
        self.depth += 1;
        self.i += 1;
        Ok(())
    }

    fn array(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        self.enter()?;
        out.push(b'[');
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.i += 1;
        } else {
            loop {
                self.value(out)?;
                self.skip_ws();
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        out.push(b',');
                    }
                    Some(b']') => {
                        self.i += 1;
                        break;
                    }
                    _ => return Err(self.error("expected `,` or `]`")),
                }
            }
        }
        out.push(b']');
        self.depth -= 1;
        Ok(())
    }

    fn object(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        self.enter()?;
        out.push(b'{');
        let start = out.len();
        let first = self.members.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
        } else {
            loop {
                self.skip_ws();
                if self.peek() != Some(b'"') {
                    return Err(self.error("expected a key"));
                }
                let key = out.len();
                self.string(out)?;
                let colon = out.len();
                self.expect(b':', "expected `:`")?;
                out.push(b':');
                self.value(out)?;
                self.members.push(Member::new(out, key, colon, out.len()));
                self.skip_ws();
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        out.push(b',');
                    }
                    Some(b'}') => {
                        self.i += 1;
                        break;
                    }
                    _ => return Err(self.error("expected `,` or `}`")),
                }
            }
            self.sort_members(out, start, first);
        }
        self.members.truncate(first);
        out.push(b'}');
        self.depth -= 1;
        Ok(())
    }

    /// Puts the members written since `start` (listed from `first`) in key
    /// order, the last of equal keys kept. Already in order, nothing moves.
    fn sort_members(&mut self, out: &mut Vec<u8>, start: usize, first: usize) {
        let members = &mut self.members[first..];
        let sorted = members.windows(2).all(|w| w[0].cmp(&w[1], out, 0).is_lt());
        if sorted {
            return;
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&out[start..]);
        out.truncate(start);
        let buf = &self.scratch;
        // Stable: equal keys stay in the order they came, so the last of a
        // run is the one kept.
        members.sort_by(|a, b| a.cmp(b, buf, start));
        let mut written = false;
        for (n, m) in members.iter().enumerate() {
            let next_is_same = members
                .get(n + 1)
                .is_some_and(|next| m.cmp(next, buf, start).is_eq());
            if next_is_same {
                continue;
            }
            if written {
                out.push(b',');
            }
            out.extend_from_slice(&buf[(m.key - start)..(m.end - start)]);
            written = true;
        }
    }
}

mod number;
mod string;

#[cfg(test)]
mod tests;
