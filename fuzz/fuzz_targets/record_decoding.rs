//! Decoding stored records: `RecordRow::into_record`, the one function every
//! store (SQLite, PostgreSQL, Redis) hands the fields it read back to, and
//! `StoredResponse::decode_headers`, the decoder of the stored header blob.
//! (`idem_sql::decode_record`, generic over a sqlx `Row` that only a
//! database can make, and the Redis store's private `decode` only move
//! columns or hash fields into a `RecordRow`.)
//!
//! The first input byte picks the mode: 0 a header blob (the rest of the
//! input, as a store column holds it), 1 a stored row (read by `RowReader`),
//! 2 a valid record built with `arbitrary` and written as the stores write
//! it.
//!
//! Properties:
//! - never panics on arbitrary bytes / arbitrary rows;
//! - `decode_headers` accepts exactly the blobs `encode_headers` can write:
//!   decoding then encoding gives the same bytes back;
//! - a row is accepted exactly when it is well formed (32-byte fingerprint,
//!   a UUID, a known state with its fields, a status of three digits (100 to 999),
//!   decodable headers), and the record says what the row said;
//! - record -> row (as the stores write it) -> record is the identity.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use idem_core::{
    FencingToken, Fingerprint, OperationId, Record, RecordRow, RecordState, StoredResponse,
    UnixMillis,
};
use libfuzzer_sys::fuzz_target;
use uuid::Uuid;

/// Reads a stored row from bytes, field after field, in the column order
/// of the SQL stores; bytes that run out read as empty / zero / absent, so
/// every input is a row.
///
/// - text and byte fields: a `u16` big-endian length, then that many bytes
///   (text is read lossily as UTF-8, as a TEXT column holds UTF-8);
/// - integers: 8 bytes big-endian;
/// - optional fields: a flag byte (odd: present), then the field.
struct RowReader<'a>(&'a [u8]);

impl RowReader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let (head, tail) = self.0.split_at(n.min(self.0.len()));
        self.0 = tail;
        head
    }
    fn bytes(&mut self) -> Vec<u8> {
        let len = self.take(2);
        let len = match len {
            [a, b] => usize::from(u16::from_be_bytes([*a, *b])),
            [a] => usize::from(*a),
            _ => 0,
        };
        self.take(len).to_vec()
    }
    fn text(&mut self) -> String {
        String::from_utf8_lossy(&self.bytes()).into_owned()
    }
    fn int(&mut self) -> i64 {
        let mut b = [0u8; 8];
        let got = self.take(8);
        b[..got.len()].copy_from_slice(got);
        i64::from_be_bytes(b)
    }
    fn present(&mut self) -> bool {
        self.take(1).first().is_some_and(|f| f % 2 == 1)
    }
    fn opt_int(&mut self) -> Option<i64> {
        self.present().then(|| self.int())
    }
    fn opt_bytes(&mut self) -> Option<Vec<u8>> {
        self.present().then(|| self.bytes())
    }
    fn row(mut self) -> RecordRow {
        RecordRow {
            scope: self.text(),
            key: self.text(),
            fingerprint: self.bytes(),
            operation_id: self.text(),
            state: self.text(),
            token: self.opt_int(),
            locked_until: self.opt_int(),
            created_at: self.int(),
            expires_at: self.int(),
            completed_at: self.opt_int(),
            status: self.opt_int(),
            headers: self.opt_bytes(),
            body: self.opt_bytes(),
            shortest_retention: self.opt_int(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum RecState {
    InProgress {
        token: i64,
        locked_until: i64,
    },
    Completed {
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        completed_at: i64,
    },
}

#[derive(Arbitrary, Debug)]
struct Rec {
    scope: String,
    key: String,
    fingerprint: [u8; 32],
    operation_id: [u8; 16],
    created_at: i64,
    expires_at: i64,
    shortest_retention: Option<u32>,
    state: RecState,
}

fn encode(headers: Vec<(String, Vec<u8>)>) -> Vec<u8> {
    StoredResponse {
        status: 200,
        headers,
        body: Vec::new().into(),
    }
    .encode_headers()
}

/// Decoding a blob, then encoding what it decoded to, gives the blob back.
fn check_headers(blob: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    let decoded = StoredResponse::decode_headers(blob).ok()?;
    assert_eq!(encode(decoded.clone()), blob, "decode then encode");
    Some(decoded)
}

/// The row the stores write for a record (SQL columns; Redis keeps the same
/// fields under short names and hands them over as this row too).
fn to_row(record: &Record) -> RecordRow {
    let mut row = RecordRow {
        scope: record.scope.clone(),
        key: record.key.clone(),
        fingerprint: record.fingerprint.as_bytes().to_vec(),
        operation_id: record.operation_id.0.to_string(),
        created_at: record.created_at.0,
        expires_at: record.expires_at.0,
        shortest_retention: record
            .shortest_retention
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        ..RecordRow::default()
    };
    match &record.state {
        RecordState::InProgress {
            token,
            locked_until,
        } => {
            row.state = "in_progress".into();
            row.token = Some(token.0);
            row.locked_until = Some(locked_until.0);
        }
        RecordState::Completed {
            response,
            completed_at,
        } => {
            row.state = "completed".into();
            row.status = Some(i64::from(response.status));
            row.headers = Some(response.encode_headers());
            row.body = Some(response.body.to_vec());
            row.completed_at = Some(completed_at.0);
        }
    }
    row
}

fn check_row(row: RecordRow) {
    let decoded_headers = row.headers.as_deref().map(check_headers);
    let result = row.clone().into_record();

    // The oracle.
    let common = row.fingerprint.len() == 32 && Uuid::parse_str(&row.operation_id).is_ok();
    let state_ok = match row.state.as_str() {
        "in_progress" => row.token.is_some() && row.locked_until.is_some(),
        "completed" => {
            row.status.is_some_and(|s| (100..=999).contains(&s))
                && matches!(decoded_headers, Some(Some(_)))
                && row.body.is_some()
                && row.completed_at.is_some()
        }
        _ => false,
    };
    // A retention is never negative; absent, it is not known.
    let common = common && row.shortest_retention.is_none_or(|ms| ms >= 0);
    let record = match result {
        Ok(record) => {
            assert!(common && state_ok, "accepted a malformed row: {row:?}");
            record
        }
        Err(e) => {
            assert!(!(common && state_ok), "rejected a good row ({e}): {row:?}");
            return;
        }
    };
    assert_eq!(record.scope, row.scope);
    assert_eq!(record.key, row.key);
    assert_eq!(record.fingerprint.as_bytes().as_slice(), row.fingerprint);
    assert_eq!(
        Ok(record.operation_id.0),
        Uuid::parse_str(&row.operation_id)
    );
    assert_eq!(record.created_at, UnixMillis(row.created_at));
    assert_eq!(record.expires_at, UnixMillis(row.expires_at));
    assert_eq!(
        record.shortest_retention,
        row.shortest_retention
            .map(|ms| std::time::Duration::from_millis(ms as u64))
    );
    match &record.state {
        RecordState::InProgress {
            token,
            locked_until,
        } => {
            assert_eq!(row.state, "in_progress");
            assert_eq!(Some(token.0), row.token);
            assert_eq!(Some(locked_until.0), row.locked_until);
        }
        RecordState::Completed {
            response,
            completed_at,
        } => {
            assert_eq!(row.state, "completed");
            assert_eq!(Some(i64::from(response.status)), row.status);
            assert_eq!(Some(response.encode_headers()), row.headers);
            assert_eq!(Some(&response.headers), decoded_headers.flatten().as_ref());
            assert_eq!(Some(response.body.to_vec()), row.body);
            assert_eq!(Some(completed_at.0), row.completed_at);
        }
    }
    // Written back and read again: the same record.
    assert_eq!(to_row(&record).into_record().as_ref(), Ok(&record));
}

fn check_record(rec: Rec) {
    let record = Record {
        scope: rec.scope,
        key: rec.key,
        fingerprint: Fingerprint::from_bytes(rec.fingerprint),
        operation_id: OperationId(Uuid::from_bytes(rec.operation_id)),
        created_at: UnixMillis(rec.created_at),
        expires_at: UnixMillis(rec.expires_at),
        shortest_retention: rec
            .shortest_retention
            .map(|ms| std::time::Duration::from_millis(u64::from(ms))),
        state: match rec.state {
            RecState::InProgress {
                token,
                locked_until,
            } => RecordState::InProgress {
                token: FencingToken(token),
                locked_until: UnixMillis(locked_until),
            },
            RecState::Completed {
                status,
                headers,
                body,
                completed_at,
            } => RecordState::Completed {
                response: StoredResponse {
                    // what a handler can answer: three digits
                    status: 100 + status % 900,
                    headers,
                    body: body.into(),
                },
                completed_at: UnixMillis(completed_at),
            },
        },
    };
    let row = to_row(&record);
    if let Some(h) = &row.headers {
        check_headers(h).expect("encoded headers decode");
    }
    assert_eq!(row.into_record(), Ok(record));
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks what the rest is.
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            check_headers(rest);
        }
        1 => check_row(RowReader(rest).row()),
        _ => {
            if let Ok(rec) = Rec::arbitrary_take_rest(Unstructured::new(rest)) {
                check_record(rec);
            }
        }
    }
});
