//! Numbers: integers that fit 64 bits keep their digits, anything else is
//! the nearest double in ECMAScript's shortest spelling.

use super::Parser;
use super::Step;

impl Parser<'_> {
    fn digits(&mut self) -> usize {
        let from = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        self.i - from
    }

    /// A number. It stays in the pending run if it is spelled as it must
    /// be; otherwise its spelling is written in its place.
    pub(super) fn number(&mut self, out: &mut Vec<u8>) -> Step {
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
                    return Err(self.fault("leading zero in a number"));
                }
            }
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.fault("invalid number")),
        }
        let int = &self.s[int_start..self.i];
        let mut fraction = None;
        if self.peek() == Some(b'.') {
            self.i += 1;
            let from = self.i;
            if self.digits() == 0 {
                return Err(self.fault("invalid number"));
            }
            fraction = Some(&self.s[from..self.i]);
        }
        let mut exponent = false;
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.fault("invalid number"));
            }
            exponent = true;
        }
        let as_it_stands = match (fraction, exponent) {
            (None, false) if int == b"0" => !negative,
            // Up to 18 digits always fit.
            (None, false) if int.len() <= 18 => true,
            (None, false) => parse_u64(int).is_some_and(|magnitude| {
                // -2^63 is the most negative integer that fits.
                !negative || magnitude <= 1 << 63
            }),
            (Some(fraction), false) => is_shortest_fixed(int, fraction),
            (_, true) => false,
        };
        if as_it_stands {
            return Ok(());
        }
        // `-0` too: the double it reads as is zero, written `0`.
        self.flush_to(start, out);
        self.float(&self.s[start..self.i], out)?;
        self.resume();
        Ok(())
    }

    fn float(&mut self, token: &[u8], out: &mut Vec<u8>) -> Step {
        // The token is ASCII by construction.
        let text = std::str::from_utf8(token).map_err(|_| self.fault("invalid number"))?;
        let value: f64 = text.parse().map_err(|_| self.fault("invalid number"))?;
        if !value.is_finite() {
            return Err(self.fault("number out of range"));
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

/// Whether a number with a fraction and no exponent, its integer part
/// `int` and fraction `fraction`, is already how ECMAScript would write the
/// double it denotes: no trailing zero in the fraction, at most 15
/// significant digits (so no shorter or closer spelling denotes the same
/// double), and at least 1e-6 in magnitude (below that ECMAScript switches
/// to exponent notation). The common `12.5` then stays as it is instead of
/// being parsed and formatted.
fn is_shortest_fixed(int: &[u8], fraction: &[u8]) -> bool {
    if fraction.last() == Some(&b'0') {
        return false;
    }
    let significant = if int == b"0" {
        let zeros = fraction.iter().take_while(|&&b| b == b'0').count();
        if zeros > 5 {
            return false;
        }
        fraction.len() - zeros
    } else {
        int.len() + fraction.len()
    };
    significant <= 15
}
