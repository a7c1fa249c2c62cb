//! Canonical JSON in one pass over the bytes, without building a value.
//!
//! The spelling is the one idem has always fingerprinted (that of
//! `serde_json` parsing and `serde_jcs` writing), so records written before
//! stay comparable, but for numbers whose exact value that spelling changed
//! (see the number rule and `idem_core::fingerprint`) and objects holding a
//! key twice (refused now; that spelling kept the last). The
//! `canonical_json` fuzz target checks the two agree on every other input,
//! errors included:
//!
//! - no insignificant whitespace;
//! - object members sorted by the bytes of their canonical key, quotes
//!   included;
//! - strings with the minimal escapes: `\"`, `\\`, `\b \f \n \r \t`, and
//!   `\u00xx` (lowercase) for the other control characters; everything else
//!   as UTF-8;
//! - a number keeps its exact value, its significant digits laid out as
//!   ECMAScript lays out a double's (`1.0` is `1`, `1e2` is `100`, `1e21`
//!   is `1e+21`, `-0` is `0`): where that value is the value of
//!   ECMAScript's shortest spelling of the nearest double, that spelling;
//!   otherwise (more digits than a double tells apart, or below its range)
//!   every significant digit, where the old spelling rounded to a double;
//! - what `serde_json` refuses is refused: a lone surrogate escape, a raw
//!   control character in a string, invalid UTF-8, a number too large for
//!   a double, nesting 128 deep, anything after the value; and (which it
//!   read as zero) a non-zero number so small that its spelling's exponent
//!   would not fit 64 bits; and (which it read as the last) an object
//!   holding a key twice, keys compared as the strings they denote.

use std::cmp::Ordering;

use crate::fingerprint::CanonicalJsonError;

/// Containers nested this deep are refused (as `serde_json` does).
const MAX_DEPTH: usize = 128;

/// Why an object holding a key twice is refused (see the module docs).
const DUPLICATE_KEY: &str = "duplicate key in the object ending";

/// Canonicalises `input` into `out` (appended).
///
/// Most of a body is already canonical as it stands: the parser only reads
/// it, and copies each such run in one piece when something different must
/// be written (whitespace dropped, an escape or a number respelled, the
/// members of an object reordered) or at the end.
pub(crate) fn canonicalize(input: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalJsonError> {
    let spare = SPARE.take();
    let (read, spare) = spare.canonicalize(input, out);
    SPARE.set(spare);
    read
}

/// Canonicalises `input` into an output buffer this thread keeps, and
/// gives `f` the canonical bytes (or the refusal).
pub(crate) fn with_canonical<R>(
    input: &[u8],
    f: impl FnOnce(Result<&[u8], CanonicalJsonError>) -> R,
) -> R {
    let mut spare = SPARE.take();
    let mut out = std::mem::take(&mut spare.out);
    let (read, mut spare) = spare.canonicalize(input, &mut out);
    let answer = f(read.map(|()| out.as_slice()));
    spare.out = cleared(out);
    SPARE.set(spare);
    answer
}

/// The parser's working space, and an output buffer, kept by each thread
/// between bodies so that a body of a few members allocates nothing.
#[derive(Default)]
struct Spare {
    frames: Vec<Frame>,
    members: Vec<Member>,
    scratch: Vec<u8>,
    order: Vec<usize>,
    out: Vec<u8>,
}

impl Spare {
    /// Runs the parser over `input` with this working space; the space
    /// comes back emptied.
    fn canonicalize(
        self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> (Result<(), CanonicalJsonError>, Self) {
        let mut p = Parser {
            s: input,
            i: 0,
            run: 0,
            frames: self.frames,
            members: self.members,
            scratch: self.scratch,
            order: self.order,
            shape: Shape::NONE,
            refusal: Fault { what: "", at: 0 },
        };
        let read = p.document(out).and_then(|()| {
            p.skip_ws(out);
            if p.i == p.s.len() {
                Ok(())
            } else {
                Err(p.fault("trailing characters"))
            }
        });
        let read = match read {
            Ok(()) => {
                p.flush(out);
                Ok(())
            }
            Err(Refused) => Err(CanonicalJsonError(format!(
                "{} at byte {}",
                p.refusal.what, p.refusal.at
            ))),
        };
        let spare = Self {
            frames: cleared(p.frames),
            members: cleared(p.members),
            scratch: cleared(p.scratch),
            order: cleared(p.order),
            out: self.out,
        };
        (read, spare)
    }
}

/// `v` emptied, or let go if it grew beyond a mebibyte.
fn cleared<T>(mut v: Vec<T>) -> Vec<T> {
    v.clear();
    if v.capacity() * size_of::<T>() > 1 << 20 {
        Vec::new()
    } else {
        v
    }
}

thread_local! {
    static SPARE: std::cell::Cell<Spare> = const {
        std::cell::Cell::new(Spare {
            frames: Vec::new(),
            members: Vec::new(),
            scratch: Vec::new(),
            order: Vec::new(),
            out: Vec::new(),
        })
    };
}

/// Why and where the input was refused; spelled out once, at the end.
#[derive(Clone, Copy)]
struct Fault {
    what: &'static str,
    at: usize,
}

/// The input was refused: the parser holds the [`Fault`]. (Nothing to
/// carry back through every step, the steps stay cheap to return from.)
struct Refused;

/// What each step of the parser gives back.
type Step = Result<(), Refused>;

/// One object member: where its key starts and ends (quotes included), as
/// positions in the output (see [`Parser::at`]). Where its value ends is not
/// kept: one comma stands before the next member's key in the output,
/// whatever whitespace stood in the input, and the object's last member
/// ends at its `}` (see [`end_of`]).
#[derive(Clone, Copy)]
struct Member {
    /// The key's first bytes after its opening quote, big-endian and padded
    /// with zeros: ordering by it orders by the key, but for keys that share
    /// these bytes (no key holds a zero byte, nor is one a prefix of
    /// another, for each ends in its closing quote).
    prefix: u64,
    key: usize,
    colon: usize,
}

impl Member {
    /// Whether the two keys are the same; `held` holds the members.
    fn same_key(&self, other: &Self, held: Held<'_>) -> bool {
        self.prefix == other.prefix
            && held.bytes(self.key, self.colon) == held.bytes(other.key, other.colon)
    }

    /// Orders by key; `held` holds the members.
    fn cmp(&self, other: &Self, held: Held<'_>) -> Ordering {
        self.prefix.cmp(&other.prefix).then_with(|| {
            held.bytes(self.key, self.colon)
                .cmp(held.bytes(other.key, other.colon))
        })
    }
}

/// Where members' bytes are held: the bytes at output positions `from..to`
/// stand at `buf[from + base..to + base]` (`base` a difference, added with
/// wrapping arithmetic). The positions are read through it rather than
/// every member's being rewritten (which, just after the parser wrote them,
/// would wait on those stores).
#[derive(Clone, Copy)]
struct Held<'b> {
    buf: &'b [u8],
    base: usize,
}

impl<'b> Held<'b> {
    /// `buf`, whose byte at `to` is the one at output position `from`.
    fn new(buf: &'b [u8], from: usize, to: usize) -> Self {
        Self {
            buf,
            base: to.wrapping_sub(from),
        }
    }

    /// Where output position `at` stands in `buf`.
    fn at(self, at: usize) -> usize {
        at.wrapping_add(self.base)
    }

    /// The bytes at output positions `from..to`.
    fn bytes(self, from: usize, to: usize) -> &'b [u8] {
        &self.buf[self.at(from)..self.at(to)]
    }
}

/// A container being read.
#[derive(Clone, Copy)]
struct Frame {
    object: bool,
    /// An object's first member, as an index into [`Parser::members`].
    first: usize,
    /// Whether some key came before the one before it.
    inverted: bool,
    /// Whether some key shared the prefix of the one before it.
    tied: bool,
}

impl Frame {
    const ARRAY: Self = Self {
        object: false,
        first: 0,
        inverted: false,
        tied: false,
    };

    fn object(first: usize) -> Self {
        Self {
            object: true,
            first,
            ..Self::ARRAY
        }
    }
}

/// The prefix of a key (see [`Member::prefix`]) whose bytes after the
/// opening quote, closing quote included, are the `len` bytes of `buf` from
/// `at` on.
fn key_prefix(buf: &[u8], at: usize, len: usize) -> u64 {
    match buf.get(at..).and_then(<[u8]>::first_chunk::<8>) {
        // The bytes beyond the key (if it is shorter) are masked off.
        Some(eight) if len >= 8 => u64::from_be_bytes(*eight),
        Some(eight) => u64::from_be_bytes(*eight) & !(u64::MAX >> (8 * len)),
        None => buf[at..at + len.min(8)]
            .iter()
            .enumerate()
            .fold(0, |p, (n, &b)| p | u64::from(b) << (56 - 8 * n)),
    }
}

/// A small object's keys, told apart by their prefixes alone, and their
/// order. The objects of an array often share their keys in the same order:
/// the next object whose prefixes are these, in this order, has this order
/// too (keys whose prefixes differ are ordered by them, and are unique),
/// without the sort.
struct Shape {
    /// How many members (0: none yet).
    len: usize,
    prefixes: [u64; 16],
    order: [usize; 16],
}

impl Shape {
    const NONE: Self = Self {
        len: 0,
        prefixes: [0; 16],
        order: [0; 16],
    };

    /// The order of `members` if their prefixes are this shape's.
    fn order_of(&self, members: &[Member]) -> Option<&[usize]> {
        let prefixes = self.prefixes.get(..members.len())?;
        (self.len == members.len() && members.iter().zip(prefixes).all(|(m, &p)| m.prefix == p))
            .then(|| &self.order[..members.len()])
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    /// Where the run of input that is canonical as it stands, and not yet
    /// written, begins: `s[run..i]` comes next in the output.
    run: usize,
    /// The containers being read, innermost last.
    frames: Vec<Frame>,
    /// The members of the objects being read, innermost last.
    members: Vec<Member>,
    /// Where an unsorted object's members wait while they are reordered.
    scratch: Vec<u8>,
    /// An unsorted object's members' indices, in key order.
    order: Vec<usize>,
    /// The last small object sorted whose keys' prefixes all differ.
    shape: Shape,
    /// Why the input was refused, once it is.
    refusal: Fault,
}

impl Parser<'_> {
    /// Refuses the input where it now stands.
    #[cold]
    fn fault(&mut self, what: &'static str) -> Refused {
        self.refusal = Fault { what, at: self.i };
        Refused
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    /// Where the byte at `i` will stand in the output.
    fn at(&self, out: &[u8]) -> usize {
        out.len() + (self.i - self.run)
    }

    /// Writes the pending run of canonical input.
    fn flush(&mut self, out: &mut Vec<u8>) {
        append(out, self.s, self.run, self.i);
        self.run = self.i;
    }

    /// Writes the pending run up to `to`, where input that is spelled
    /// otherwise begins; the caller writes that spelling, then resumes the
    /// run after it.
    fn flush_to(&mut self, to: usize, out: &mut Vec<u8>) {
        append(out, self.s, self.run, to);
    }

    /// Starts a new pending run where the input now stands.
    fn resume(&mut self) {
        self.run = self.i;
    }

    fn skip_ws(&mut self, out: &mut Vec<u8>) {
        // Whitespace and the control characters are all at or below the
        // space; anything above is not whitespace.
        if let Some(0..=b' ') = self.peek() {
            self.skip_ws_slow(out);
        }
    }

    fn skip_ws_slow(&mut self, out: &mut Vec<u8>) {
        if let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.flush(out);
            self.i += 1;
            while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
                self.i += 1;
            }
            self.resume();
        }
    }

    /// The whole document: one value, containers and all. Containers are
    /// tracked in `frames` rather than by recursion, so the parser's state
    /// stays in registers from one token to the next.
    fn document(&mut self, out: &mut Vec<u8>) -> Step {
        let mut frames = std::mem::take(&mut self.frames);
        let read = self.values(&mut frames, out);
        self.frames = cleared(frames);
        read
    }

    fn values(&mut self, frames: &mut Vec<Frame>, out: &mut Vec<u8>) -> Step {
        'value: loop {
            // A value begins.
            self.skip_ws(out);
            match self.peek() {
                Some(b'{') => {
                    self.enter(frames.len())?;
                    self.skip_ws(out);
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                    } else {
                        let mut frame = Frame::object(self.members.len());
                        self.key(&mut frame, out)?;
                        frames.push(frame);
                        continue 'value;
                    }
                }
                Some(b'[') => {
                    self.enter(frames.len())?;
                    self.skip_ws(out);
                    if self.peek() == Some(b']') {
                        self.i += 1;
                    } else {
                        frames.push(Frame::ARRAY);
                        continue 'value;
                    }
                }
                Some(b'"') => self.string(out)?,
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(b'-' | b'0'..=b'9') => self.number(out)?,
                Some(_) => return Err(self.fault("expected a value")),
                None => return Err(self.fault("unexpected end")),
            }
            // A value ended: close every container it completes.
            while let Some(frame) = frames.last_mut() {
                self.skip_ws(out);
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        if frame.object {
                            self.key(frame, out)?;
                        }
                        continue 'value;
                    }
                    Some(b'}') if frame.object => {
                        if frame.inverted || frame.tied {
                            self.sort_members(out, frame.first, frame.inverted)?;
                        }
                        self.i += 1;
                        self.members.truncate(frame.first);
                    }
                    Some(b']') if !frame.object => self.i += 1,
                    _ if frame.object => return Err(self.fault("expected `,` or `}`")),
                    _ => return Err(self.fault("expected `,` or `]`")),
                }
                frames.pop();
            }
            return Ok(());
        }
    }

    fn literal(&mut self, word: &[u8]) -> Step {
        if self.s[self.i..].starts_with(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(self.fault("expected a literal"))
        }
    }

    /// Steps over a container's opening bracket, `open` containers being
    /// open around it.
    fn enter(&mut self, open: usize) -> Step {
        if open + 1 >= MAX_DEPTH {
            return Err(self.fault("nested too deep"));
        }
        self.i += 1;
        Ok(())
    }

    /// A member's key and its colon, the member then recorded (where its
    /// value ends is worked out when the object is sorted: see [`end_of`]).
    #[inline(always)]
    fn key(&mut self, frame: &mut Frame, out: &mut Vec<u8>) -> Step {
        self.skip_ws(out);
        if self.peek() != Some(b'"') {
            return Err(self.fault("expected a key"));
        }
        let key = self.at(out);
        let key_in = self.i;
        let prefix = match self.short_key() {
            Some(prefix) => prefix,
            None => {
                self.string(out)?;
                if self.run <= key_in {
                    // As it stands in the input.
                    key_prefix(self.s, key_in + 1, self.i - key_in - 1)
                } else {
                    // Respelled: written out in full.
                    self.flush(out);
                    key_prefix(out, key + 1, out.len() - key - 1)
                }
            }
        };
        // Whether each key so far came after the one before it (a tie in
        // the prefix counts as not: the sort then looks closer); whether
        // some key came before the one before it, or shared its prefix
        // (then only the sort can tell).
        if let Some(last) = self.members.get(frame.first..).and_then(<[Member]>::last) {
            frame.inverted |= last.prefix > prefix;
            frame.tied |= last.prefix == prefix;
        }
        let colon = self.at(out);
        self.skip_ws(out);
        if self.peek() != Some(b':') {
            return Err(self.fault("expected `:`"));
        }
        self.i += 1;
        self.members.push(Member { prefix, key, colon });
        Ok(())
    }

    /// A key of at most seven bytes of plain ASCII, from its opening quote:
    /// stepped over, and its prefix (see [`Member::prefix`]) taken from the
    /// same eight bytes its closing quote was found in. `None` (nothing
    /// read) for any other key.
    #[inline(always)]
    fn short_key(&mut self) -> Option<u64> {
        let eight = self.s.get(self.i + 1..)?.first_chunk::<8>()?;
        let found = string::stops(u64::from_le_bytes(*eight));
        // The closing quote's index, or 8 when none of the bytes stops.
        let n = (found.trailing_zeros() / 8) as usize;
        if eight.get(n) != Some(&b'"') {
            return None;
        }
        // The key's bytes up to its closing quote, that included.
        let len = n + 1;
        self.i += 1 + len;
        Some(u64::from_be_bytes(*eight) & u64::MAX << (64 - 8 * len))
    }

    /// Puts the members read since `first` (the input stands at the
    /// object's `}`) in key order; refuses the object if two keys are the
    /// same. Already in order, nothing moves. Members still in the pending
    /// run are written from the input; others, from a copy of the output.
    fn sort_members(&mut self, out: &mut Vec<u8>, first: usize, inverted: bool) -> Step {
        let Some(start) = self.members.get(first).map(|m| m.key) else {
            return Ok(());
        };
        // Where the `}` will stand, the last member's end.
        let close = self.at(out);
        // Either every member is still in the pending run, or the run is
        // written and every member is in the output.
        let in_run = start >= out.len();
        let held = if in_run {
            Held::new(self.s, out.len(), self.run)
        } else {
            self.flush(out);
            Held::new(out, 0, 0)
        };
        let members = &self.members[first..];
        if !inverted && members.windows(2).all(|w| w[0].cmp(&w[1], held).is_lt()) {
            return Ok(());
        }
        // The members' indices in key order.
        let mut few = [0; 16];
        let known = self.shape.order_of(members);
        let order = match (known, few.get_mut(..members.len())) {
            (Some(known), _) => known,
            (None, Some(order)) => {
                for n in 0..order.len() {
                    let mut at = n;
                    while let Some(&before) = at.checked_sub(1).and_then(|b| order.get(b)) {
                        match members[n].cmp(&members[before], held) {
                            Ordering::Less => {
                                order[at] = before;
                                at -= 1;
                            }
                            Ordering::Equal => return Err(self.fault(DUPLICATE_KEY)),
                            Ordering::Greater => break,
                        }
                    }
                    order[at] = n;
                }
                if order
                    .windows(2)
                    .all(|w| members[w[0]].prefix < members[w[1]].prefix)
                {
                    self.shape.len = order.len();
                    for (n, &m) in order.iter().enumerate() {
                        self.shape.prefixes[n] = members[n].prefix;
                        self.shape.order[n] = m;
                    }
                }
                &*order
            }
            (None, None) => {
                let order = &mut self.order;
                order.clear();
                order.extend(0..members.len());
                order.sort_unstable_by(|&a, &b| members[a].cmp(&members[b], held));
                if order
                    .windows(2)
                    .any(|w| members[w[0]].same_key(&members[w[1]], held))
                {
                    return Err(self.fault(DUPLICATE_KEY));
                }
                &order[..]
            }
        };
        // In the output, the members from `keep` on may already stand where
        // they belong: then only those before them are written again.
        let keep = if in_run {
            order.len()
        } else {
            order
                .iter()
                .enumerate()
                .rposition(|(n, &m)| n != m)
                .map_or(0, |n| n + 1)
        };
        if in_run {
            let input = Held::new(self.s, out.len(), self.run);
            append(out, self.s, self.run, input.at(members[0].key));
            write_members(members, order, close, input, out);
        } else {
            let written = Written {
                members,
                order,
                keep,
                close,
            };
            written.rewrite(out, &mut self.scratch);
        }
        self.run = self.i;
        Ok(())
    }
}

/// An object's members already in the output, with their key order.
struct Written<'m> {
    members: &'m [Member],
    order: &'m [usize],
    /// The members from this one on stand where they belong.
    keep: usize,
    /// Where the object's `}` stands.
    close: usize,
}

impl Written<'_> {
    /// Writes the members again in key order, `scratch` holding the bytes
    /// they are read from. (Out of the parser's loop: only an object whose
    /// members were written before it closed, for one inside it was
    /// reordered or its text respelled, comes here.)
    #[inline(never)]
    fn rewrite(&self, out: &mut Vec<u8>, scratch: &mut Vec<u8>) {
        let Written {
            members,
            order,
            keep,
            close,
        } = *self;
        let Some(start) = members.first().map(|m| m.key) else {
            return;
        };
        scratch.clear();
        if let Some(stay) = members.get(keep) {
            // Same members, same commas: the bytes before `stay` are
            // rewritten in place.
            scratch.extend_from_slice(&out[start..stay.key]);
            let mut w = start;
            for &n in &order[..keep] {
                let end = end_of(members, n, close);
                let bytes = &scratch[members[n].key - start..end - start];
                out[w..w + bytes.len()].copy_from_slice(bytes);
                w += bytes.len();
                out[w] = b',';
                w += 1;
            }
        } else {
            scratch.extend_from_slice(&out[start..]);
            out.truncate(start);
            let held = Held::new(scratch, start, 0);
            write_members(members, order, close, held, out);
        }
    }
}

/// Where member `n` of an object's `members` ends in the output: before
/// the comma ahead of the next one's key, the last at the object's `}`,
/// which stands at `close`.
fn end_of(members: &[Member], n: usize, close: usize) -> usize {
    members.get(n + 1).map_or(close, |next| next.key - 1)
}

/// Writes the members `held` in key `order`, comma-separated; the
/// object's `}` stands at output position `close`.
fn write_members(
    members: &[Member],
    order: &[usize],
    close: usize,
    held: Held<'_>,
    out: &mut Vec<u8>,
) {
    // Each member with the comma before it (none before the first).
    let mut comma = false;
    for &m in order {
        let (from, to) = (members[m].key, end_of(members, m, close));
        append_after(out, comma, held.buf, held.at(from), held.at(to));
        comma = true;
    }
}

/// Appends `src[from..to]` to `out`, after a comma if `comma`. A short
/// piece is written as one block of fixed size, then cut to its length
/// (see [`append`]); its comma, over the block's first byte, the one before
/// the piece in `src`.
#[inline(always)]
fn append_after(out: &mut Vec<u8>, comma: bool, src: &[u8], from: usize, to: usize) {
    let start = out.len();
    let lead = from.checked_sub(usize::from(comma));
    match lead.and_then(|at| src.get(at..)?.first_chunk::<32>()) {
        Some(block) if to - from < 32 => {
            out.extend_from_slice(block);
            if comma {
                out[start] = b',';
            }
            out.truncate(start + usize::from(comma) + (to - from));
        }
        _ => {
            if comma {
                out.push(b',');
            }
            out.extend_from_slice(&src[from..to]);
        }
    }
}

/// Appends `src[from..to]` to `out`. A piece of a member's length is
/// copied as one block of fixed size, then cut to its length, where `src`
/// holds that many bytes from `from` on: the copy is then a few moves
/// rather than a call to `memcpy`, which costs more than the bytes for
/// pieces this short.
#[inline(always)]
fn append(out: &mut Vec<u8>, src: &[u8], from: usize, to: usize) {
    let len = out.len() + (to - from);
    if to - from <= 16 {
        if let Some(block) = src.get(from..).and_then(<[u8]>::first_chunk::<16>) {
            out.extend_from_slice(block);
            out.truncate(len);
            return;
        }
    } else if to - from <= 32 {
        if let Some(block) = src.get(from..).and_then(<[u8]>::first_chunk::<32>) {
            out.extend_from_slice(block);
            out.truncate(len);
            return;
        }
    }
    out.extend_from_slice(&src[from..to]);
}

mod number;
#[cfg(test)]
mod oracle;
mod string;

#[cfg(test)]
mod tests;
