//! Strings: plain text stepped over a word at a time, escapes decoded and,
//! where they were not, written with the minimal escapes.

use super::Parser;
use super::{Refused, Step};

/// Eight bytes with `b` in each.
const fn splat(b: u8) -> u64 {
    0x0101_0101_0101_0101 * b as u64
}

/// The high bit of each byte of `w` that is a quote, a backslash, a control
/// character or not ASCII; the lowest one set is the first such byte (the
/// borrows that may set others only run upwards from a byte that is one).
pub(super) fn stops(w: u64) -> u64 {
    const HIGH: u64 = splat(0x80);
    let zero_in = |x: u64| x.wrapping_sub(splat(1)) & !x & HIGH;
    zero_in(w ^ splat(b'"'))
        | zero_in(w ^ splat(b'\\'))
        | (w.wrapping_sub(splat(0x20)) & !w & HIGH)
        | (w & HIGH)
}

impl Parser<'_> {
    /// A string, from its opening quote. Its text stays in the pending run
    /// but where an escape is spelled otherwise than the minimal way.
    #[inline(always)]
    pub(super) fn string(&mut self, out: &mut Vec<u8>) -> Step {
        self.i += 1;
        loop {
            self.plain_ascii();
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(());
                }
                Some(b'\\') => self.escape(out)?,
                Some(0..0x20) => return Err(self.fault("control character in a string")),
                Some(_) => self.utf8_char()?,
                None => return Err(self.fault("unterminated string")),
            }
        }
    }

    /// Steps over printable ASCII other than the quote and the backslash,
    /// eight bytes at a time.
    fn plain_ascii(&mut self) {
        while let Some(eight) = self.s.get(self.i..).and_then(<[u8]>::first_chunk::<8>) {
            let found = stops(u64::from_le_bytes(*eight));
            if found != 0 {
                self.i += (found.trailing_zeros() / 8) as usize;
                return;
            }
            self.i += 8;
        }
        while let Some(b' '..=0x7F) = self.peek() {
            if let Some(b'"' | b'\\') = self.peek() {
                return;
            }
            self.i += 1;
        }
    }

    /// Steps over one character of two to four bytes, which must be UTF-8.
    fn utf8_char(&mut self) -> Step {
        let width = match self.peek() {
            Some(0xC2..=0xDF) => 2,
            Some(0xE0..=0xEF) => 3,
            Some(0xF0..=0xF4) => 4,
            _ => 0,
        };
        match self.s.get(self.i..self.i + width) {
            Some(bytes) if width > 0 && std::str::from_utf8(bytes).is_ok() => {
                self.i += width;
                Ok(())
            }
            _ => Err(self.fault("invalid UTF-8 in a string")),
        }
    }

    /// An escape, from its backslash. The minimal ones stay in the pending
    /// run; any other is written as the character it stands for.
    fn escape(&mut self, out: &mut Vec<u8>) -> Step {
        let start = self.i;
        self.i += 1;
        let Some(b) = self.peek() else {
            return Err(self.fault("unterminated escape"));
        };
        self.i += 1;
        let c = match b {
            b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't' => return Ok(()),
            b'/' => '/',
            b'u' => self.unicode_escape()?,
            _ => return Err(self.fault("invalid escape")),
        };
        self.flush_to(start, out);
        write_char(c, out);
        self.resume();
        Ok(())
    }

    /// After `\u`: one character, a surrogate pair taken together; a lone
    /// surrogate is refused.
    fn unicode_escape(&mut self) -> Result<char, Refused> {
        let n = self.hex4()?;
        let code = match n {
            0xDC00..=0xDFFF => return Err(self.fault("lone trailing surrogate")),
            0xD800..=0xDBFF => {
                if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                    return Err(self.fault("lone leading surrogate"));
                }
                self.i += 2;
                let low = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(self.fault("lone leading surrogate"));
                }
                0x1_0000 + ((u32::from(n) - 0xD800) << 10) + (u32::from(low) - 0xDC00)
            }
            n => u32::from(n),
        };
        char::from_u32(code).ok_or_else(|| self.fault("invalid code point"))
    }

    fn hex4(&mut self) -> Result<u16, Refused> {
        let digits = self
            .s
            .get(self.i..self.i + 4)
            .ok_or_else(|| self.fault("short \\u escape"))?;
        let mut n = 0u16;
        for &d in digits {
            let v = match d {
                b'0'..=b'9' => d - b'0',
                b'a'..=b'f' => d - b'a' + 10,
                b'A'..=b'F' => d - b'A' + 10,
                _ => return Err(self.fault("invalid \\u escape")),
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
