//! Numbers: each written as the exact decimal value its spelling denotes,
//! laid out as ECMAScript's `Number.prototype.toString` lays out digits.
//!
//! Where that value is the value of ECMAScript's shortest spelling of the
//! nearest double (as for `0.1`, `1e21` or `12.5`), the spelling is that
//! one, as it always was; an integer that fits 64 bits keeps its digits, as
//! it always did. Any other number (more digits than a double tells apart,
//! or below its range) keeps every significant digit it was sent with, so
//! two amounts a double cannot tell apart never share a fingerprint.

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
        let mut fraction: &[u8] = &[];
        let mut has_fraction = false;
        if self.peek() == Some(b'.') {
            self.i += 1;
            let from = self.i;
            if self.digits() == 0 {
                return Err(self.fault("invalid number"));
            }
            fraction = &self.s[from..self.i];
            has_fraction = true;
        }
        let mut exponent = None;
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            let from = self.i;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(self.fault("invalid number"));
            }
            exponent = Some(&self.s[from..self.i]);
        }
        let as_it_stands = match (has_fraction, exponent) {
            (false, None) if int == b"0" => !negative,
            // Integers are written with all their digits up to 21 of them.
            (false, None) => int.len() <= 21,
            (true, None) => is_shortest_fixed(int, fraction),
            (_, Some(_)) => false,
        };
        if as_it_stands {
            return Ok(());
        }
        // `-0` too: the number is zero, written `0`.
        let token = Token {
            negative,
            int,
            fraction,
            exponent,
        };
        self.flush_to(start, out);
        self.respell(&token, start, out)?;
        self.resume();
        Ok(())
    }

    /// Writes the number `token` (which starts at byte `start`) in its
    /// canonical spelling. Refused: a number too large for a double, and
    /// one so small that its spelling's exponent would not fit 64 bits.
    fn respell(&mut self, token: &Token<'_>, start: usize, out: &mut Vec<u8>) -> Step {
        // The token is ASCII by construction.
        let text = std::str::from_utf8(&self.s[start..self.i])
            .map_err(|_| self.fault("invalid number"))?;
        let double: f64 = text.parse().map_err(|_| self.fault("invalid number"))?;
        if !double.is_finite() {
            return Err(self.fault("number out of range"));
        }
        match token.decimal() {
            Exact::Zero => out.push(b'0'),
            Exact::Value(decimal) => decimal.write(out),
            Exact::OutOfRange => return Err(self.fault("number out of range")),
        }
        Ok(())
    }
}

/// A number token's parts, as the grammar reads them.
struct Token<'a> {
    negative: bool,
    /// The integer part's digits.
    int: &'a [u8],
    /// The fraction's digits (empty when there is none).
    fraction: &'a [u8],
    /// The exponent, its sign included, when there is one.
    exponent: Option<&'a [u8]>,
}

/// The exact value of a [`Token`].
enum Exact<'a> {
    Zero,
    Value(Decimal<'a>),
    /// Its spelling's exponent would not fit 64 bits (which a spelling
    /// read back must: the refusal depends on the value alone).
    OutOfRange,
}

/// A non-zero decimal number: `0.d₁d₂…dₖ × 10ⁿ`, its significant digits
/// `d₁ … dₖ` (no leading or trailing zero) read in place from the token's
/// integer and fraction digits.
struct Decimal<'a> {
    negative: bool,
    int: &'a [u8],
    fraction: &'a [u8],
    /// Where the significant digits start and end among the token's
    /// integer digits followed by its fraction digits.
    from: usize,
    to: usize,
    /// The power of ten just above the number: `10ⁿ⁻¹ ≤ |value| < 10ⁿ`.
    n: i128,
}

impl Token<'_> {
    fn digit(&self, at: usize) -> u8 {
        match self.int.get(at) {
            Some(&d) => d,
            None => self.fraction[at - self.int.len()],
        }
    }

    fn decimal(&self) -> Exact<'_> {
        let all = self.int.len() + self.fraction.len();
        let Some(from) = (0..all).find(|&at| self.digit(at) != b'0') else {
            return Exact::Zero;
        };
        let to = (from..all)
            .rev()
            .find(|&at| self.digit(at) != b'0')
            .map_or(all, |last| last + 1);
        let exponent = match self.exponent {
            None => 0,
            Some(e) => match exponent(e) {
                Some(e) => e,
                // Beyond 2^127, while the digits are fewer than 2^64: the
                // value's own exponent is past 64 bits too.
                None => return Exact::OutOfRange,
            },
        };
        // Lengths are below 2^64 and the exponent below 2^127 in magnitude.
        let n = ((all - from) as i128 - self.fraction.len() as i128).saturating_add(exponent);
        // The exponent written is n - 1 (when one is), and read back it must
        // fit 64 bits. (Past i64::MAX upwards a double is infinite anyway.)
        if n.saturating_sub(1).unsigned_abs() > i64::MAX as u128 {
            return Exact::OutOfRange;
        }
        Exact::Value(Decimal {
            negative: self.negative,
            int: self.int,
            fraction: self.fraction,
            from,
            to,
            n,
        })
    }
}

/// An exponent's value (`+12`, `-3`, `7`), or `None` when it does not fit
/// 128 bits.
fn exponent(e: &[u8]) -> Option<i128> {
    let (negative, digits) = match e.split_first() {
        Some((b'-', rest)) => (true, rest),
        Some((b'+', rest)) => (false, rest),
        _ => (false, e),
    };
    let magnitude = digits.iter().try_fold(0i128, |n, &d| {
        n.checked_mul(10)?.checked_add(i128::from(d - b'0'))
    })?;
    Some(if negative { -magnitude } else { magnitude })
}

impl Decimal<'_> {
    /// Appends the significant digits `from..to` (relative to the first).
    fn digits(&self, from: usize, to: usize, out: &mut Vec<u8>) {
        let (from, to) = (self.from + from, self.from + to);
        let int = self.int.len();
        if from < int {
            out.extend_from_slice(&self.int[from..to.min(int)]);
        }
        if to > int {
            out.extend_from_slice(&self.fraction[from.max(int) - int..to - int]);
        }
    }

    /// ECMAScript's layout (`Number::toString`, steps 6 to 10) of these
    /// digits: plain up to 21 integer digits, `0.` and up to five zeros
    /// before a small one, an exponent otherwise.
    fn write(&self, out: &mut Vec<u8>) {
        let k = self.to - self.from;
        let n = self.n;
        if self.negative {
            out.push(b'-');
        }
        let zeros = |count: i128, out: &mut Vec<u8>| {
            out.extend(std::iter::repeat_n(b'0', count.max(0) as usize));
        };
        if (k as i128) <= n && n <= 21 {
            self.digits(0, k, out);
            zeros(n - k as i128, out);
        } else if 0 < n && n <= 21 {
            // Here n < k, so the point falls among the digits.
            let point = n as usize;
            self.digits(0, point, out);
            out.push(b'.');
            self.digits(point, k, out);
        } else if -6 < n && n <= 0 {
            out.extend_from_slice(b"0.");
            zeros(-n, out);
            self.digits(0, k, out);
        } else {
            self.digits(0, 1, out);
            if k > 1 {
                out.push(b'.');
                self.digits(1, k, out);
            }
            out.push(b'e');
            out.push(if n - 1 < 0 { b'-' } else { b'+' });
            out.extend_from_slice((n - 1).unsigned_abs().to_string().as_bytes());
        }
    }
}

/// Whether a number with a fraction and no exponent, its integer part
/// `int` and fraction `fraction`, is already spelled as it must be: no
/// trailing zero in the fraction, and at least 1e-6 in magnitude (below
/// that the layout switches to an exponent). The common `12.5` then stays
/// as it is instead of being respelled.
fn is_shortest_fixed(int: &[u8], fraction: &[u8]) -> bool {
    if fraction.last() == Some(&b'0') {
        return false;
    }
    if int == b"0" {
        fraction.iter().take_while(|&&b| b == b'0').count() <= 5
    } else {
        int.len() <= 21
    }
}
