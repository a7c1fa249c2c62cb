//! A record as one Redis value: a MessagePack array, which the Lua scripts
//! read and write with Redis's bundled `cmsgpack` and this module with a few
//! lines of its own. One value means a replay is one `GET` and one reply
//! to parse, not a hash's two dozen.
//!
//! The array, by position (1-based in Lua):
//!
//! | # | field | in progress | completed |
//! |---|---|---|---|
//! | 1 | layout version | `1` | `1` |
//! | 2 | scope | string | string |
//! | 3 | key | string | string |
//! | 4 | fingerprint | 32 bytes | 32 bytes |
//! | 5 | operation id | UUID string | UUID string |
//! | 6 | fencing token | decimal string | decimal string |
//! | 7 | state | `"p"` | `"c"` |
//! | 8 | lease's end (ms) | integer | `0` |
//! | 9 | created (ms) | integer | integer |
//! | 10 | retention's end (ms) | integer | integer |
//! | 11 | completed (ms) | `0` | integer |
//! | 12 | status | `0` | integer |
//! | 13 | headers | `""` | bytes |
//! | 14 | body | `""` | bytes |
//! | 15 | shortest retention (ms) | integer | integer |
//!
//! Field 15, the shortest retention any claim of the record asked for (what
//! run-once's steps rely on their records being kept for), is absent from a
//! value an idem before it wrote: it is then not known. An idem before it
//! refuses a value that has it (a rolling upgrade's older instances answer
//! such keys with an error until they are replaced; none misreads one).
//!
//! Layout 2 is a claim made by one plain `SET … NX` (the first look), which
//! cannot read Redis's clock before it writes: the same fields, but in
//! progress with 8 the lease's length (ms), 9 the retention's length (ms),
//! 10 `0`, and the key set to expire after the longer of the two. Its times
//! are read from that expiry: created = the key's `PEXPIRETIME` − the longer
//! length, so every reader (the scripts, and this module with the value and
//! `PEXPIRETIME` read in one pipeline) gets the very same times, on Redis's
//! clock alone. The first script that changes such a record writes it as
//! layout 1.
//!
//! Strings and bytes are MessagePack `str` (what `cmsgpack` writes for a
//! Lua string, whatever its bytes); `bin` is read too. No field is `nil`
//! (a Lua array cannot hold one). Any other layout version is refused (by
//! the scripts too), so a newer idem's records are never misread.

use bytes::Bytes;
use idem_core::{Record, RecordParts, RecordState, StoreError};

/// The layout this module and the scripts write.
pub(crate) const LAYOUT: i64 = 1;

/// The layout of a claim made by one plain `SET … NX`: its times follow
/// from the key's expiry (see the module docs).
pub(crate) const NEW_CLAIM: i64 = 2;

/// Redis's clock and a key's expiry (`TIME` and `PEXPIRETIME`, read in one
/// pipeline with the key's value), to read a [`NEW_CLAIM`] by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyClock {
    /// Redis's clock, unix ms.
    pub(crate) now: i64,
    /// The key's `PEXPIRETIME`: when it expires (unix ms); -1 if it has no
    /// expiry, -2 if there is no key.
    pub(crate) expires: i64,
}

/// A claim made by one plain `SET … NX`: its value, and how long the key
/// lives (the longer of lease and retention, ms; at least 1).
pub(crate) struct NewClaim {
    /// The value, in layout [`NEW_CLAIM`].
    pub(crate) value: Vec<u8>,
    /// The key's time to live, for `PX`.
    pub(crate) ttl: i64,
}

impl NewClaim {
    /// The claim of `token` under `operation_id` for a lease of `lease` ms
    /// and a retention of `retention` ms.
    pub(crate) fn new(
        scope: &str,
        key: &str,
        fingerprint: &[u8],
        operation_id: &str,
        token: i64,
        lease: i64,
        retention: i64,
    ) -> Self {
        let value = encode_layout(
            NEW_CLAIM,
            &Parts {
                scope,
                key,
                fingerprint,
                operation_id,
                token,
                completed: false,
                locked_until: lease,
                created_at: retention,
                expires_at: 0,
                completed_at: 0,
                status: 0,
                headers: b"",
                body: b"",
                shortest_retention: Some(retention),
            },
        );
        Self {
            value,
            ttl: lease.max(retention).max(1),
        }
    }

    /// When a claim of this layout was made, read by `clock`: its key's
    /// expiry minus the life it was given.
    fn created(clock: KeyClock, lease: i64, retention: i64) -> Result<i64, StoreError> {
        if clock.expires < 0 {
            return Err(corrupt("a claim counted from its key's expiry has none"));
        }
        Ok(clock.expires - lease.max(retention).max(1))
    }
}

/// The fields of [`LAYOUT`].
const FIELDS: usize = 15;

/// The fields of a value written before field 15 (the shortest retention).
const FIELDS_BEFORE: usize = 14;

/// One decoded MessagePack item.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Item<'a> {
    Int(i64),
    Float(f64),
    Bytes(&'a [u8]),
    Nil,
    Bool(bool),
}

/// What a record's parts are, to encode (the scripts write the same).
#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) operation_id: &'a str,
    pub(crate) token: i64,
    pub(crate) completed: bool,
    pub(crate) locked_until: i64,
    pub(crate) created_at: i64,
    pub(crate) expires_at: i64,
    pub(crate) completed_at: i64,
    pub(crate) status: i64,
    pub(crate) headers: &'a [u8],
    pub(crate) body: &'a [u8],
    /// The shortest retention any claim asked for (ms), if known.
    pub(crate) shortest_retention: Option<i64>,
}

fn put_int(out: &mut Vec<u8>, v: i64) {
    match v {
        0..=127 => out.push(v as u8),
        _ => {
            out.push(0xd3);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

fn put_str(out: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if let Ok(n) = u8::try_from(n) {
        out.extend_from_slice(&[0xd9, n]);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xda);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        out.push(0xdb);
        // A Redis value is at most 512 MiB, far below u32's limit.
        out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
    }
    out.extend_from_slice(b);
}

/// Puts `v` as a string of its decimal digits (`-` first if negative), as
/// `v.to_string()` spells it, without a `String` made for it.
fn put_decimal(out: &mut Vec<u8>, v: i64) {
    put_str(out, itoa::Buffer::new().format(v).as_bytes());
}

/// Encodes `parts` as the one value of [`LAYOUT`].
pub(crate) fn encode(p: &Parts<'_>) -> Vec<u8> {
    encode_layout(LAYOUT, p)
}

fn encode_layout(layout: i64, p: &Parts<'_>) -> Vec<u8> {
    // Beside the strings' own bytes, at most: the array's head and the
    // layout (1 + 9), eight strings' heads (8 × 5), the token's digits (20),
    // the state (1), six integers (6 × 9): 125 bytes. The value is then
    // written without growing.
    let mut out = Vec::with_capacity(
        125 + p.scope.len()
            + p.key.len()
            + p.fingerprint.len()
            + p.operation_id.len()
            + p.headers.len()
            + p.body.len(),
    );
    let fields = if p.shortest_retention.is_some() {
        FIELDS
    } else {
        FIELDS_BEFORE
    };
    out.push(0x90 | fields as u8);
    put_int(&mut out, layout);
    put_str(&mut out, p.scope.as_bytes());
    put_str(&mut out, p.key.as_bytes());
    put_str(&mut out, p.fingerprint);
    put_str(&mut out, p.operation_id.as_bytes());
    put_decimal(&mut out, p.token);
    put_str(&mut out, if p.completed { b"c" } else { b"p" });
    put_int(&mut out, p.locked_until);
    put_int(&mut out, p.created_at);
    put_int(&mut out, p.expires_at);
    put_int(&mut out, p.completed_at);
    put_int(&mut out, p.status);
    put_str(&mut out, p.headers);
    put_str(&mut out, p.body);
    if let Some(ms) = p.shortest_retention {
        put_int(&mut out, ms);
    }
    out
}

/// Encodes a completed record (the tier's cached copy).
pub(crate) fn encode_record(record: &Record) -> Option<Vec<u8>> {
    let RecordState::Completed {
        response,
        completed_at,
    } = &record.state
    else {
        return None;
    };
    let headers = response.encode_headers();
    let op = record.operation_id.0.to_string();
    Some(encode(&Parts {
        scope: &record.scope,
        key: &record.key,
        fingerprint: record.fingerprint.as_bytes(),
        operation_id: &op,
        token: 0,
        completed: true,
        locked_until: 0,
        created_at: record.created_at.0,
        expires_at: record.expires_at.0,
        completed_at: completed_at.0,
        status: i64::from(response.status),
        headers: &headers,
        body: &response.body,
        // Not kept in the copy: the tier answers replays from it, and the
        // store behind it keeps the record whole (what a takeover or a
        // step reads). Left out, the copy stays readable by an idem
        // before field 15, so a rolling upgrade keeps its tier.
        shortest_retention: None,
    }))
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("a stored record does not decode: {what}"))
}

/// Reads MessagePack items from a byte slice.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        if self.bytes.len() < n {
            return Err(corrupt("it ends early"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn be(&mut self, n: usize) -> Result<u64, StoreError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, StoreError> {
        usize::try_from(self.be(n)?).map_err(|_| corrupt("a length overflows"))
    }

    fn array(&mut self) -> Result<usize, StoreError> {
        let tag = self.take(1)?[0];
        match tag {
            0x90..=0x9f => Ok(usize::from(tag & 0x0f)),
            0xdc => self.len(2),
            0xdd => self.len(4),
            _ => Err(corrupt("not an array")),
        }
    }

    fn item(&mut self) -> Result<Item<'a>, StoreError> {
        let tag = self.take(1)?[0];
        Ok(match tag {
            0x00..=0x7f => Item::Int(i64::from(tag)),
            0xe0..=0xff => Item::Int(i64::from(tag as i8)),
            0xc0 => Item::Nil,
            0xc2 => Item::Bool(false),
            0xc3 => Item::Bool(true),
            0xcc => Item::Int(self.be(1)? as i64),
            0xcd => Item::Int(self.be(2)? as i64),
            0xce => Item::Int(self.be(4)? as i64),
            0xcf => {
                Item::Int(i64::try_from(self.be(8)?).map_err(|_| corrupt("an integer overflows"))?)
            }
            0xd0 => Item::Int(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => Item::Int(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => Item::Int(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => Item::Int(self.be(8)? as i64),
            0xca => Item::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Item::Float(f64::from_bits(self.be(8)?)),
            0xa0..=0xbf => Item::Bytes(self.take(usize::from(tag & 0x1f))?),
            0xd9 | 0xc4 => {
                let n = self.len(1)?;
                Item::Bytes(self.take(n)?)
            }
            0xda | 0xc5 => {
                let n = self.len(2)?;
                Item::Bytes(self.take(n)?)
            }
            0xdb | 0xc6 => {
                let n = self.len(4)?;
                Item::Bytes(self.take(n)?)
            }
            _ => return Err(corrupt("an item of a kind no record holds")),
        })
    }
}

fn int(item: Item<'_>, what: &str) -> Result<i64, StoreError> {
    match item {
        Item::Int(n) => Ok(n),
        // Lua numbers are doubles: an integral one may come back as one.
        Item::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(f as i64),
        _ => Err(corrupt(what)),
    }
}

fn bytes<'a>(item: Item<'a>, what: &str) -> Result<&'a [u8], StoreError> {
    match item {
        Item::Bytes(b) => Ok(b),
        _ => Err(corrupt(what)),
    }
}

fn str_of<'a>(item: Item<'a>, what: &str) -> Result<&'a str, StoreError> {
    std::str::from_utf8(bytes(item, what)?).map_err(|_| corrupt(what))
}

fn text(item: Item<'_>, what: &str) -> Result<String, StoreError> {
    str_of(item, what).map(str::to_owned)
}

/// Decodes the one value of a record. A claim of layout [`NEW_CLAIM`] is
/// read by `clock` (its key's, read with it); without one it is an error.
/// A completed record's body is copied out of `value`.
pub(crate) fn decode(value: &[u8], clock: Option<KeyClock>) -> Result<Record, StoreError> {
    decode_with(value, clock, Bytes::copy_from_slice)
}

/// [`decode`] for a value the reader owns: a completed record's body is
/// sliced out of it, not copied.
pub(crate) fn decode_owned(value: Vec<u8>, clock: Option<KeyClock>) -> Result<Record, StoreError> {
    let value = Bytes::from(value);
    decode_with(&value, clock, |body| value.slice_ref(body))
}

/// [`decode`], the body made by `body` from its bytes in `value`.
fn decode_with(
    value: &[u8],
    clock: Option<KeyClock>,
    body: impl FnOnce(&[u8]) -> Bytes,
) -> Result<Record, StoreError> {
    let mut r = Reader { bytes: value };
    let n = r.array()?;
    if n == 0 {
        return Err(corrupt("an empty array"));
    }
    let layout = int(r.item()?, "the layout version")?;
    if !(layout == LAYOUT || layout == NEW_CLAIM) || !(n == FIELDS || n == FIELDS_BEFORE) {
        return Err(StoreError::Corrupt(format!(
            "a stored record has layout {layout} with {n} fields; this idem reads layouts \
             {LAYOUT} and {NEW_CLAIM} ({FIELDS_BEFORE} or {FIELDS} fields): was it written by a \
             newer version?"
        )));
    }
    let scope = text(r.item()?, "the scope")?;
    let key = text(r.item()?, "the key")?;
    let fingerprint = bytes(r.item()?, "the fingerprint")?;
    let operation_id = str_of(r.item()?, "the operation id")?;
    let token = match r.item()? {
        Item::Bytes(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("the token"))?,
        other => int(other, "the token")?,
    };
    let completed = match bytes(r.item()?, "the state")? {
        b"p" => false,
        b"c" => true,
        _ => return Err(corrupt("the state")),
    };
    let mut locked_until = int(r.item()?, "the lease's end")?;
    let mut created_at = int(r.item()?, "created_at")?;
    let mut expires_at = int(r.item()?, "expires_at")?;
    // A claim of NEW_CLAIM was made by its one `SET … NX` and never taken
    // over (a script rewrites it as LAYOUT): its retention is the shortest.
    let mut claimed_retention = None;
    if layout == NEW_CLAIM {
        let clock =
            clock.ok_or_else(|| corrupt("a claim counted from its key's expiry, unread"))?;
        if completed {
            return Err(corrupt("a completed record in a claim's layout"));
        }
        let (lease, retention) = (locked_until, created_at);
        if lease < 0 || retention < 0 {
            return Err(corrupt("a claim's lengths"));
        }
        created_at = NewClaim::created(clock, lease, retention)?;
        locked_until = created_at
            .checked_add(lease)
            .ok_or_else(|| corrupt("the lease's length"))?;
        expires_at = created_at
            .checked_add(retention)
            .ok_or_else(|| corrupt("the retention's length"))?;
        claimed_retention = Some(retention);
    }
    let completed_at = int(r.item()?, "completed_at")?;
    let status = int(r.item()?, "the status")?;
    let headers = bytes(r.item()?, "the headers")?;
    let stored_body = bytes(r.item()?, "the body")?;
    let shortest_retention = if n == FIELDS {
        Some(int(r.item()?, "the shortest retention")?)
    } else {
        None
    };
    let parts = RecordParts {
        scope,
        key,
        fingerprint,
        operation_id,
        state: if completed {
            "completed"
        } else {
            "in_progress"
        },
        token: Some(token),
        locked_until: (!completed).then_some(locked_until),
        created_at,
        expires_at,
        shortest_retention: claimed_retention.or(shortest_retention),
        completed_at: completed.then_some(completed_at),
        status: completed.then_some(status),
        headers: completed.then_some(headers),
        body: completed.then(|| body(stored_body)),
    };
    Ok(parts.into_record()?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use idem_core::{FencingToken, Fingerprint, OperationId, StoredResponse, UnixMillis};

    fn completed(body_len: usize) -> Record {
        Record {
            scope: "tenant-ü".into(),
            key: "k".repeat(40),
            fingerprint: Fingerprint::from_bytes([7; 32]),
            operation_id: OperationId::generate(),
            created_at: UnixMillis(1_700_000_000_000),
            expires_at: UnixMillis(1_700_086_400_000),
            shortest_retention: None,
            state: RecordState::Completed {
                response: StoredResponse {
                    status: 201,
                    headers: vec![("content-type".into(), b"application/json".to_vec())],
                    body: bytes::Bytes::from(vec![b'x'; body_len]),
                },
                completed_at: UnixMillis(1_700_000_000_250),
            },
        }
    }

    /// A token is spelled as `to_string` spells it, at every width and
    /// sign; and a value is written into the room made for it at first.
    #[test]
    fn tokens_spelled_in_decimal_and_values_written_without_growing() {
        for token in [
            0,
            1,
            -1,
            9,
            10,
            -10,
            99,
            100,
            1_234_567_890,
            -987_654_321_012,
            i64::MAX,
            i64::MIN,
            i64::MIN + 1,
        ] {
            let mut spelled = Vec::new();
            put_decimal(&mut spelled, token);
            let mut want = Vec::new();
            put_str(&mut want, token.to_string().as_bytes());
            assert_eq!(spelled, want, "{token}");
            for long in [0, 31, 32, 256, 65_536] {
                let text = "s".repeat(long);
                let p = Parts {
                    scope: &text,
                    key: &text,
                    fingerprint: &[7; 32],
                    operation_id: &text,
                    token,
                    completed: true,
                    locked_until: i64::MIN,
                    created_at: i64::MAX,
                    expires_at: -1,
                    completed_at: 128,
                    status: 599,
                    headers: text.as_bytes(),
                    body: text.as_bytes(),
                    shortest_retention: Some(i64::MAX),
                };
                let value = encode(&p);
                // The room `encode` makes: no more is ever written.
                let room = 125 + 5 * long + 32;
                assert!(value.len() <= room, "{token}, strings of {long}");
            }
        }
    }

    /// Every length class of string (fixstr, str8, str16, str32) and the
    /// record's every field come back as they went.
    #[test]
    fn a_record_comes_back_whole() {
        for len in [0, 5, 31, 32, 255, 256, 65_535, 65_536, 200_000] {
            let record = completed(len);
            let value = encode_record(&record).unwrap();
            assert_eq!(decode(&value, None).unwrap(), record, "body of {len} bytes");
            // Read from a value it owns, the reader slices the body out of
            // it rather than copying it.
            let span = value.as_ptr_range();
            let owned = decode_owned(value, None).unwrap();
            assert_eq!(owned, record, "body of {len} bytes, owned");
            let RecordState::Completed { response, .. } = &owned.state else {
                panic!("completed");
            };
            if len > 0 {
                assert!(
                    span.contains(&response.body.as_ptr()),
                    "body of {len} bytes, copied"
                );
            }
        }
        let p = Parts {
            scope: "s",
            key: "k",
            fingerprint: &[3; 32],
            operation_id: "00000000-0000-0000-0000-000000000009",
            token: 9_007_199_254_740_993,
            completed: false,
            locked_until: 1_700_000_030_000,
            created_at: 0,
            expires_at: 1_700_000_030_000,
            completed_at: 0,
            status: 0,
            headers: b"",
            body: b"",
            shortest_retention: None,
        };
        let record = decode(&encode(&p), None).unwrap();
        assert_eq!(
            record.state,
            RecordState::InProgress {
                token: FencingToken(9_007_199_254_740_993),
                locked_until: UnixMillis(1_700_000_030_000)
            }
        );
        assert_eq!(record.shortest_retention, None, "fourteen fields");
        // Field 15, the shortest retention, in every integer form.
        for ms in [0, 127, 128, 86_400_000, 3_155_760_000_000] {
            let kept = Parts {
                shortest_retention: Some(ms),
                ..p
            };
            let record = decode(&encode(&kept), None).unwrap();
            assert_eq!(
                record.shortest_retention,
                Some(std::time::Duration::from_millis(ms as u64)),
                "{ms}"
            );
        }
        // The tier's copy of a completed record leaves it out, so that an
        // idem before field 15 reads the copy.
        let mut copied = completed(3);
        copied.shortest_retention = Some(std::time::Duration::from_secs(60));
        let value = encode_record(&copied).unwrap();
        assert_eq!(value[0], 0x90 | FIELDS_BEFORE as u8);
    }

    /// What Lua's cmsgpack writes for the same record: integers in their
    /// smallest form or as doubles, strings as str, bytes as bin.
    #[test]
    fn every_integer_and_string_form_reads() {
        let mut v = vec![0x9e, 0x01];
        for s in [&b"s"[..], b"k"] {
            v.push(0xa0 | s.len() as u8);
            v.extend_from_slice(s);
        }
        v.extend_from_slice(&[0xc4, 32]);
        v.extend_from_slice(&[1; 32]);
        let op = b"00000000-0000-0000-0000-000000000001";
        v.extend_from_slice(&[0xd9, op.len() as u8]);
        v.extend_from_slice(op);
        v.extend_from_slice(&[0xa2, b'4', b'2', 0xa1, b'c']);
        v.push(0x00); // lease's end
        v.push(0xcb); // created, as a double
        v.extend_from_slice(&1_700_000_000_000f64.to_bits().to_be_bytes());
        v.push(0xcf); // expires, u64
        v.extend_from_slice(&1_700_000_100_000u64.to_be_bytes());
        v.push(0xce); // completed, u32
        v.extend_from_slice(&4_000_000_000u32.to_be_bytes());
        v.extend_from_slice(&[0xcd, 0x01, 0xf4]); // 500
        v.extend_from_slice(&[0xa0, 0xc5, 0x00, 0x02, b'{', b'}']);
        let record = decode(&v, None).unwrap();
        assert_eq!(record.created_at, UnixMillis(1_700_000_000_000));
        assert_eq!(record.expires_at, UnixMillis(1_700_000_100_000));
        match record.state {
            RecordState::Completed {
                response,
                completed_at,
            } => {
                assert_eq!(response.status, 500);
                assert_eq!(&response.body[..], b"{}");
                assert_eq!(completed_at, UnixMillis(4_000_000_000));
            }
            other => panic!("{other:?}"),
        }
        for (bytes, n) in [
            (vec![0xd0, 0xfe], -2),
            (vec![0xd1, 0xff, 0xfe], -2),
            (vec![0xd2, 0xff, 0xff, 0xff, 0xfe], -2),
            (vec![0xfe], -2),
            (vec![0xcc, 0xff], 255),
        ] {
            assert_eq!(
                Reader { bytes: &bytes }.item().unwrap(),
                Item::Int(n),
                "{bytes:?}"
            );
        }
    }

    /// Bad bytes are a typed error, never a panic; a newer layout is refused.
    #[test]
    fn bad_values_are_corrupt_and_a_newer_layout_is_refused() {
        let good = encode_record(&completed(10)).unwrap();
        for cut in 0..good.len() {
            assert!(
                matches!(decode(&good[..cut], None), Err(StoreError::Corrupt(_))),
                "cut at {cut}"
            );
        }
        let mut newer = good.clone();
        newer[1] = 3;
        match decode(&newer, None) {
            Err(StoreError::Corrupt(m)) => assert!(m.contains("layout 3"), "{m}"),
            other => panic!("{other:?}"),
        }
        // A completed record never takes the claim's layout.
        newer[1] = 2;
        let clock = KeyClock { now: 1, expires: 1 };
        assert!(matches!(
            decode(&newer, Some(clock)),
            Err(StoreError::Corrupt(_))
        ));
        for junk in [&b""[..], b"\x90", b"\xc1", b"hello", b"\x9e\xff"] {
            assert!(matches!(decode(junk, None), Err(StoreError::Corrupt(_))));
        }
    }

    /// A claim made by one `SET … NX` is read by its key's expiry: made
    /// the life it was given before it, its lease and retention counted
    /// from then; unreadable without the clock, with a key that has no
    /// expiry, or with a negative length.
    #[test]
    fn a_new_claim_is_read_by_its_keys_expiry() {
        let op = "00000000-0000-0000-0000-000000000007";
        let claim = NewClaim::new("s", "k", &[5; 32], op, 42, 30_000, 3_600_000);
        assert_eq!(claim.ttl, 3_600_000);
        // 1,000 ms after it was made (at 1_700_000_000_000)
        let clock = KeyClock {
            now: 1_700_000_001_000,
            expires: 1_700_003_600_000,
        };
        let record = decode(&claim.value, Some(clock)).unwrap();
        assert_eq!(record.created_at, UnixMillis(1_700_000_000_000));
        assert_eq!(record.expires_at, UnixMillis(1_700_003_600_000));
        assert_eq!(
            record.state,
            RecordState::InProgress {
                token: FencingToken(42),
                locked_until: UnixMillis(1_700_000_030_000),
            }
        );
        assert_eq!(record.operation_id.0.to_string(), op);
        assert_eq!(record.fingerprint.as_bytes(), &[5; 32]);
        // A lease longer than the retention: the key lives for the lease.
        let long = NewClaim::new("s", "k", &[5; 32], op, 42, 7_200_000, 3_600_000);
        assert_eq!(long.ttl, 7_200_000);
        let record = decode(
            &long.value,
            Some(KeyClock {
                now: 10_000_000,
                expires: 17_200_000,
            }),
        )
        .unwrap();
        assert_eq!(record.created_at, UnixMillis(10_000_000));
        assert!(matches!(
            record.state,
            RecordState::InProgress {
                locked_until: UnixMillis(17_200_000),
                ..
            }
        ));
        let negative = NewClaim::new("s", "k", &[5; 32], op, 42, -1, 1);
        assert!(matches!(
            decode(&negative.value, Some(clock)),
            Err(StoreError::Corrupt(_))
        ));
        for clock in [
            None,
            Some(KeyClock {
                now: 1,
                expires: -1,
            }),
        ] {
            assert!(matches!(
                decode(&claim.value, clock),
                Err(StoreError::Corrupt(_))
            ));
        }
    }
}
