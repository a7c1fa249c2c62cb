//! Strings: one run of plain text copied at a time, escapes decoded and
//! written again with the minimal escapes.

use super::Parser;
use crate::fingerprint::CanonicalJsonError;

/// The bytes that end a run of plain string text: the quote, the backslash
/// and the control characters.
const NEEDS_CARE: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

impl Parser<'_> {
    /// A string, from its opening quote, written with the minimal escapes.
    pub(super) fn string(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        self.i += 1;
        out.push(b'"');
        loop {
            // The run of bytes that need no care, copied as they are once
            // they are known to be UTF-8.
            let rest = &self.s[self.i..];
            let n = rest
                .iter()
                .position(|&b| NEEDS_CARE[usize::from(b)])
                .unwrap_or(rest.len());
            let text = &rest[..n];
            self.i += n;
            if !text.is_ascii() && std::str::from_utf8(text).is_err() {
                return Err(self.error("invalid UTF-8 in a string"));
            }
            out.extend_from_slice(text);
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    out.push(b'"');
                    return Ok(());
                }
                Some(b'\\') => {
                    self.i += 1;
                    self.escape(out)?;
                }
                Some(_) => return Err(self.error("control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
        }
    }

    fn escape(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        let Some(b) = self.peek() else {
            return Err(self.error("unterminated escape"));
        };
        self.i += 1;
        let c = match b {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => self.unicode_escape()?,
            _ => return Err(self.error("invalid escape")),
        };
        write_char(c, out);
        Ok(())
    }

    /// After `\u`: one character, a surrogate pair taken together; a lone
    /// surrogate is refused.
    fn unicode_escape(&mut self) -> Result<char, CanonicalJsonError> {
        let n = self.hex4()?;
        let code = match n {
            0xDC00..=0xDFFF => return Err(self.error("lone trailing surrogate")),
            0xD800..=0xDBFF => {
                if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                    return Err(self.error("lone leading surrogate"));
                }
                self.i += 2;
                let low = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(self.error("lone leading surrogate"));
                }
                0x1_0000 + ((u32::from(n) - 0xD800) << 10) + (u32::from(low) - 0xDC00)
            }
            n => u32::from(n),
        };
        char::from_u32(code).ok_or_else(|| self.error("invalid code point"))
    }

    fn hex4(&mut self) -> Result<u16, CanonicalJsonError> {
        let digits = self
            .s
            .get(self.i..self.i + 4)
            .ok_or_else(|| self.error("short \\u escape"))?;
        let mut n = 0u16;
        for &d in digits {
            let v = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => return Err(self.error("invalid \\u escape")),
            };
            n = n << 4 | u16::from(v);
        }
        self.i += 4;
        Ok(n)
    }
}

/// Writes one character of a string with the minimal escapes.
fn write_char(c: char, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match c {
        '"' => out.extend_from_slice(b"\\\""),
        '\\' => out.extend_from_slice(b"\\\\"),
        '\u{8}' => out.extend_from_slice(b"\\b"),
        '\u{c}' => out.extend_from_slice(b"\\f"),
        '\n' => out.extend_from_slice(b"\\n"),
        '\r' => out.extend_from_slice(b"\\r"),
        '\t' => out.extend_from_slice(b"\\t"),
        c if (c as u32) < 0x20 => {
            let b = c as u8;
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xF)],
            ]);
        }
        c => {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
}
