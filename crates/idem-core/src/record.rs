//! The idempotency record and its states.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use uuid::Uuid;

use crate::fingerprint::Fingerprint;

/// A point in time as milliseconds since the Unix epoch: the unit every store
/// keeps leases and retention in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnixMillis(pub i64);

impl UnixMillis {
    /// The current wall-clock time.
    pub fn now() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        Self(i64::try_from(ms).unwrap_or(i64::MAX))
    }

    /// This instant plus a duration, saturating.
    pub fn plus(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_add(ms))
    }

    /// How long from `self` until `later`; zero if `later` is not later.
    pub fn until(self, later: UnixMillis) -> Duration {
        Duration::from_millis(u64::try_from(later.0.saturating_sub(self.0)).unwrap_or(0))
    }
}

/// A fencing token: issued with every claim and takeover, never reused for
/// the same record. Completion and release only apply while the record still
/// carries the caller's token, so a holder whose claim was taken over (a
/// "zombie") can change nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub i64);

impl FencingToken {
    /// A fresh random token (63 random bits, never zero or negative).
    pub fn generate() -> Self {
        let v = Uuid::new_v4().as_u64_pair().0 & (i64::MAX as u64);
        Self(i64::try_from(v.max(1)).unwrap_or(1))
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A stable id for the operation a key stands for: created at the first
/// claim, kept across takeovers and releases. Pass it to systems outside the
/// database (a payment provider, an email service) as *their* idempotency key,
/// so that their effects are deduplicated too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OperationId(pub Uuid);

impl OperationId {
    /// A new, time-ordered (UUID v7) operation id.
    pub fn generate() -> Self {
        Self(Uuid::now_v7())
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A response kept for replay: status, the allow-listed headers, and the body
/// byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header names (lowercase) and raw values, in the order they were sent.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body.
    pub body: Bytes,
}

/// Stored headers could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored response headers are corrupt: {0}")]
pub struct HeaderDecodeError(&'static str);

impl StoredResponse {
    /// Encodes the headers into a compact, lossless byte string for a store
    /// column (`u16` name length, name, `u32` value length, value, repeated).
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            let name = &name.as_bytes()[..name.len().min(u16::MAX as usize)];
            let value = &value[..value.len().min(u32::MAX as usize)];
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
        out
    }

    /// Decodes what [`StoredResponse::encode_headers`] wrote.
    pub fn decode_headers(mut bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, HeaderDecodeError> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], HeaderDecodeError> {
            if b.len() < n {
                return Err(HeaderDecodeError("truncated"));
            }
            let (head, tail) = b.split_at(n);
            *b = tail;
            Ok(head)
        }
        let mut headers = Vec::new();
        while !bytes.is_empty() {
            let n = take(&mut bytes, 2)?;
            let n = u16::from_be_bytes([n[0], n[1]]) as usize;
            let name = std::str::from_utf8(take(&mut bytes, n)?)
                .map_err(|_| HeaderDecodeError("header name is not UTF-8"))?
                .to_owned();
            let v = take(&mut bytes, 4)?;
            let v = u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as usize;
            headers.push((name, take(&mut bytes, v)?.to_vec()));
        }
        Ok(headers)
    }
}

/// Where a record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A holder is running the operation.
    InProgress {
        /// The current holder's fencing token.
        token: FencingToken,
        /// When the holder's lease runs out; after it, a retry may take over.
        locked_until: UnixMillis,
    },
    /// The operation finished; its response is kept for replay.
    Completed {
        /// The response to replay.
        response: StoredResponse,
        /// When it completed.
        completed_at: UnixMillis,
    },
}

/// An idempotency record, identified by `(scope, key)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The tenant or client the key belongs to.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The fingerprint of the request that first claimed the key.
    pub fingerprint: Fingerprint,
    /// The operation id, stable across takeovers.
    pub operation_id: OperationId,
    /// When the key was first claimed.
    pub created_at: UnixMillis,
    /// When the record stops counting (creation plus retention).
    pub expires_at: UnixMillis,
    /// The shortest retention any claim of this record asked for: its first
    /// claim's, lowered by a takeover that asked for less (a takeover keeps
    /// the record for at least its own retention, so
    /// `expires_at - created_at` can only grow). What an operation's
    /// records made by any of its attempts are kept for at least. `None`:
    /// not known (a record an idem before this field wrote).
    pub shortest_retention: Option<Duration>,
    /// In progress or completed.
    pub state: RecordState,
}

impl Record {
    /// Whether the record is past its retention at `now`. A record still held
    /// under a live lease never counts as expired, so a slow operation is not
    /// run twice because its record aged out under it.
    pub fn is_expired(&self, now: UnixMillis) -> bool {
        self.expires_at <= now
            && match &self.state {
                RecordState::InProgress { locked_until, .. } => *locked_until <= now,
                RecordState::Completed { .. } => true,
            }
    }
}

/// A record as a store keeps it, field by field, before validation: what a
/// SQL row or a Redis hash holds. [`RecordRow::into_record`] checks it and
/// builds the [`Record`], the same way for every store.
#[derive(Debug, Clone, Default)]
pub struct RecordRow {
    /// The scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The fingerprint's bytes (must be 32).
    pub fingerprint: Vec<u8>,
    /// The operation id, as a UUID string.
    pub operation_id: String,
    /// `"in_progress"` or `"completed"`.
    pub state: String,
    /// The holder's token (in progress).
    pub token: Option<i64>,
    /// The lease's end, ms (in progress).
    pub locked_until: Option<i64>,
    /// Creation, ms.
    pub created_at: i64,
    /// End of retention, ms.
    pub expires_at: i64,
    /// The shortest retention any claim asked for, ms (unknown: `None`).
    pub shortest_retention: Option<i64>,
    /// Completion, ms (completed).
    pub completed_at: Option<i64>,
    /// The stored status (completed).
    pub status: Option<i64>,
    /// The stored headers, as [`StoredResponse::encode_headers`] wrote them.
    pub headers: Option<Vec<u8>>,
    /// The stored body.
    pub body: Option<Vec<u8>>,
}

/// A stored record that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CorruptRecord(pub String);

impl RecordRow {
    /// Validates the fields and builds the record.
    pub fn into_record(self) -> Result<Record, CorruptRecord> {
        RecordParts {
            scope: self.scope,
            key: self.key,
            fingerprint: &self.fingerprint,
            operation_id: &self.operation_id,
            state: &self.state,
            token: self.token,
            locked_until: self.locked_until,
            created_at: self.created_at,
            expires_at: self.expires_at,
            shortest_retention: self.shortest_retention,
            completed_at: self.completed_at,
            status: self.status,
            headers: self.headers.as_deref(),
            body: self.body.map(Bytes::from),
        }
        .into_record()
    }
}

/// A record's fields as a store read them, borrowed where the [`Record`]
/// keeps no copy of them: the same checks as [`RecordRow::into_record`]
/// (which is built on this), without an allocation for the fingerprint,
/// the operation id or the state, and with the body handed over as it is
/// (a store that read the record into [`Bytes`] slices the body out of
/// them rather than copying it).
#[derive(Debug, Clone)]
pub struct RecordParts<'a> {
    /// The scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The fingerprint's bytes (must be 32).
    pub fingerprint: &'a [u8],
    /// The operation id, as a UUID string.
    pub operation_id: &'a str,
    /// `"in_progress"` or `"completed"`.
    pub state: &'a str,
    /// The holder's token (in progress).
    pub token: Option<i64>,
    /// The lease's end, ms (in progress).
    pub locked_until: Option<i64>,
    /// Creation, ms.
    pub created_at: i64,
    /// End of retention, ms.
    pub expires_at: i64,
    /// The shortest retention any claim asked for, ms (unknown: `None`).
    pub shortest_retention: Option<i64>,
    /// Completion, ms (completed).
    pub completed_at: Option<i64>,
    /// The stored status (completed).
    pub status: Option<i64>,
    /// The stored headers, as [`StoredResponse::encode_headers`] wrote them.
    pub headers: Option<&'a [u8]>,
    /// The stored body.
    pub body: Option<Bytes>,
}

impl RecordParts<'_> {
    /// Validates the fields and builds the record.
    pub fn into_record(self) -> Result<Record, CorruptRecord> {
        let missing = |what: &str| CorruptRecord(format!("{what} is missing"));
        let fingerprint = Fingerprint::from_slice(self.fingerprint)
            .ok_or_else(|| CorruptRecord("the fingerprint is not 32 bytes".into()))?;
        let operation_id = Uuid::parse_str(self.operation_id)
            .map(OperationId)
            .map_err(|e| CorruptRecord(format!("operation id {:?}: {e}", self.operation_id)))?;
        let state = match self.state {
            "in_progress" => RecordState::InProgress {
                token: FencingToken(self.token.ok_or_else(|| missing("token"))?),
                locked_until: UnixMillis(self.locked_until.ok_or_else(|| missing("locked_until"))?),
            },
            "completed" => {
                let status = self.status.ok_or_else(|| missing("status"))?;
                RecordState::Completed {
                    response: StoredResponse {
                        // An HTTP status is three digits (RFC 9110 §15).
                        status: u16::try_from(status)
                            .ok()
                            .filter(|s| (100..=999).contains(s))
                            .ok_or_else(|| CorruptRecord(format!("status {status}")))?,
                        headers: StoredResponse::decode_headers(
                            self.headers.ok_or_else(|| missing("headers"))?,
                        )
                        .map_err(|e| CorruptRecord(e.to_string()))?,
                        body: self.body.ok_or_else(|| missing("body"))?,
                    },
                    completed_at: UnixMillis(
                        self.completed_at.ok_or_else(|| missing("completed_at"))?,
                    ),
                }
            }
            other => return Err(CorruptRecord(format!("unknown state {other:?}"))),
        };
        let shortest_retention = match self.shortest_retention {
            None => None,
            Some(ms) => {
                Some(Duration::from_millis(u64::try_from(ms).map_err(|_| {
                    CorruptRecord(format!("shortest retention {ms} ms"))
                })?))
            }
        };
        Ok(Record {
            scope: self.scope,
            key: self.key,
            fingerprint,
            operation_id,
            created_at: UnixMillis(self.created_at),
            expires_at: UnixMillis(self.expires_at),
            shortest_retention,
            state,
        })
    }
}

/// A won claim: the right to run the operation under `token` until
/// `locked_until`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The scope of the record.
    pub scope: String,
    /// The key of the record.
    pub key: String,
    /// This holder's fencing token.
    pub token: FencingToken,
    /// The operation id (the same as earlier holders' on a takeover).
    pub operation_id: OperationId,
    /// When this holder's lease runs out.
    pub locked_until: UnixMillis,
    /// Whether this claim took over an earlier holder's expired or released
    /// lease (rather than being the first).
    pub takeover: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fencing_tokens_are_positive_and_never_repeat() {
        let tokens: std::collections::HashSet<i64> =
            (0..2000).map(|_| FencingToken::generate().0).collect();
        assert_eq!(tokens.len(), 2000, "a repeated token would fence nothing");
        assert!(tokens.iter().all(|t| *t > 0));
        assert_eq!(FencingToken(42).to_string(), "42");
    }

    #[test]
    fn headers_round_trip_losslessly() {
        let r = StoredResponse {
            status: 201,
            headers: vec![
                ("location".into(), b"/payments/1".to_vec()),
                ("x-bin".into(), vec![0xff, 0x00, b'a']),
                ("empty".into(), vec![]),
            ],
            body: Bytes::from_static(b"{}"),
        };
        let enc = r.encode_headers();
        assert_eq!(StoredResponse::decode_headers(&enc).unwrap(), r.headers);
        assert!(StoredResponse::decode_headers(&enc[..enc.len() - 1]).is_err());
        assert_eq!(StoredResponse::decode_headers(&[]).unwrap(), vec![]);
    }

    #[test]
    fn rows_decode_the_same_way_for_every_store() {
        let row = RecordRow {
            scope: "s".into(),
            key: "k".into(),
            fingerprint: vec![7; 32],
            operation_id: OperationId::generate().to_string(),
            state: "completed".into(),
            created_at: 1,
            expires_at: 2,
            completed_at: Some(3),
            status: Some(201),
            headers: Some(Vec::new()),
            body: Some(b"{}".to_vec()),
            ..RecordRow::default()
        };
        let record = row.clone().into_record().unwrap();
        assert!(
            matches!(record.state, RecordState::Completed { ref response, .. } if response.status == 201)
        );
        let short_fp = RecordRow {
            fingerprint: vec![1; 3],
            ..row.clone()
        };
        assert!(short_fp.into_record().is_err());
        let no_status = RecordRow {
            status: None,
            ..row.clone()
        };
        assert!(no_status.into_record().unwrap_err().0.contains("status"));
        // a status is three digits: what no handler answered is corrupt
        for status in [0, 99, 1000, 65_535, -1] {
            let odd = RecordRow {
                status: Some(status),
                ..row.clone()
            };
            assert!(odd.into_record().is_err(), "{status}");
        }
        for status in [100, 999] {
            let fine = RecordRow {
                status: Some(status),
                ..row.clone()
            };
            assert!(fine.into_record().is_ok(), "{status}");
        }
        assert_eq!(record.shortest_retention, None);
        let kept = RecordRow {
            shortest_retention: Some(1500),
            ..row.clone()
        };
        assert_eq!(
            kept.into_record().unwrap().shortest_retention,
            Some(Duration::from_millis(1500))
        );
        let negative = RecordRow {
            shortest_retention: Some(-1),
            ..row.clone()
        };
        assert!(negative.into_record().unwrap_err().0.contains("retention"));
        let bad_state = RecordRow {
            state: "weird".into(),
            ..row.clone()
        };
        assert!(bad_state.into_record().is_err());
        let held = RecordRow {
            state: "in_progress".into(),
            token: Some(9),
            locked_until: Some(5),
            ..row
        };
        assert!(matches!(
            held.into_record().unwrap().state,
            RecordState::InProgress {
                token: FencingToken(9),
                ..
            }
        ));
    }

    #[test]
    fn tokens_are_positive_and_distinct() {
        let a = FencingToken::generate();
        let b = FencingToken::generate();
        assert!(a.0 > 0 && b.0 > 0);
        assert_ne!(a, b);
    }

    #[test]
    fn time_arithmetic_saturates() {
        let t = UnixMillis(1000);
        assert_eq!(t.plus(Duration::from_millis(500)), UnixMillis(1500));
        assert_eq!(t.until(UnixMillis(400)), Duration::ZERO);
        assert_eq!(
            UnixMillis(i64::MAX).plus(Duration::from_secs(1)),
            UnixMillis(i64::MAX)
        );
    }
}
