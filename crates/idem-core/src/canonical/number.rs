//! Numbers: integers that fit 64 bits keep their digits, anything else is
//! the nearest double in ECMAScript's shortest spelling.

use super::Parser;
use crate::fingerprint::CanonicalJsonError;

impl Parser<'_> {
    fn digits(&mut self) -> usize {
        let from = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        self.i - from
    }

    pub(super) fn number(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        let start = self.i;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let int_start = self.i;
        match self.peek() {
            Some(b'0') => {
                self.i += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.error("leading zero in a number"));
                }
            }
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.error("invalid number")),
        }
        let int_end = self.i;
        let mut integral = true;
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(self.error("invalid number"));
            }
            integral = false;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("invalid number"));
            }
            integral = false;
        }
        let token = &self.s[start..self.i];
        if integral {
            let digits = &self.s[int_start..int_end];
            if let Some(magnitude) = parse_u64(digits) {
                if magnitude == 0 {
                    out.push(b'0');
                    return Ok(());
                }
                // -2^63 is the most negative integer that fits.
                if !negative || magnitude <= 1 << 63 {
                    out.extend_from_slice(token);
                    return Ok(());
                }
            }
        } else if is_shortest_fixed(token, negative) {
            out.extend_from_slice(token);
            return Ok(());
        }
        self.float(token, out)
    }

    fn float(&self, token: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
        // The token is ASCII by construction.
        let text = std::str::from_utf8(token).map_err(|_| self.error("invalid number"))?;
        let value: f64 = text.parse().map_err(|_| self.error("invalid number"))?;
        if !value.is_finite() {
            return Err(self.error("number out of range"));
        }
        if value == 0.0 {
            out.push(b'0');
        } else {
            out.extend_from_slice(ryu_js::Buffer::new().format_finite(value).as_bytes());
        }
        Ok(())
    }
}

fn parse_u64(digits: &[u8]) -> Option<u64> {
    digits.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// Whether a number token with a fraction is already how ECMAScript would
/// write the double it denotes: no exponent, no trailing zero in the
/// fraction, at most 15 significant digits (so no shorter or closer spelling
/// denotes the same double), and at least 1e-6 in magnitude (below that
/// ECMAScript switches to exponent notation). The common `12.5` is then
/// copied instead of parsed and formatted.
fn is_shortest_fixed(token: &[u8], negative: bool) -> bool {
    let body = if negative { &token[1..] } else { token };
    let Some(dot) = body.iter().position(|&b| b == b'.') else {
        return false;
    };
    let (int, frac) = (&body[..dot], &body[dot + 1..]);
    if !frac.iter().all(u8::is_ascii_digit) || frac.last() == Some(&b'0') {
        return false;
    }
    let significant = if int == b"0" {
        let zeros = frac.iter().take_while(|&&b| b == b'0').count();
        if zeros > 5 {
            return false;
        }
        frac.len() - zeros
    } else {
        int.len() + frac.len()
    };
    significant <= 15
}
