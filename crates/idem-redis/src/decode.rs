//! Reading what the scripts return: a stored record from its hash, and
//! the fields of a reply.

use idem_core::{OperationId, Record, RecordRow, StoreError, UnixMillis};
use redis::Value;

pub(crate) fn bytes_of(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

pub(crate) fn text(v: Option<&Value>) -> Result<String, StoreError> {
    v.and_then(bytes_of)
        .and_then(|b| std::str::from_utf8(b).ok())
        .map(str::to_owned)
        .ok_or_else(|| StoreError::Corrupt("expected a string in a script reply".into()))
}

pub(crate) fn number(v: Option<&Value>) -> Result<i64, StoreError> {
    match v {
        Some(Value::Int(n)) => Ok(*n),
        // Read where it stands (TIME's two numbers come as strings, on
        // every first look): no `String` made for it.
        other => other
            .and_then(bytes_of)
            .and_then(|b| std::str::from_utf8(b).ok())
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| StoreError::Corrupt("expected a number in a script reply".into())),
    }
}

pub(crate) fn parse_op(s: &str) -> Result<OperationId, StoreError> {
    uuid::Uuid::parse_str(s)
        .map(OperationId)
        .map_err(|e| StoreError::Corrupt(format!("operation id {s:?}: {e}")))
}

/// Redis's clock, from `TIME`'s reply (seconds and microseconds), in
/// milliseconds since the epoch.
pub(crate) fn redis_time(reply: &Value) -> Result<UnixMillis, StoreError> {
    let Value::Array(parts) = reply else {
        return Err(StoreError::Corrupt("unexpected reply to TIME".into()));
    };
    let seconds = number(parts.first())?;
    let micros = number(parts.get(1))?;
    if seconds < 0 || !(0..1_000_000).contains(&micros) {
        return Err(StoreError::Corrupt(format!(
            "TIME answered {seconds} s {micros} µs"
        )));
    }
    seconds
        .checked_mul(1000)
        .and_then(|ms| ms.checked_add(micros / 1000))
        .map(UnixMillis)
        .ok_or_else(|| StoreError::Corrupt(format!("TIME answered {seconds} s {micros} µs")))
}

/// Decodes a record from a flat `field, value, …` list (HGETALL).
pub(crate) fn decode(fields: &[Value]) -> Result<Record, StoreError> {
    #[derive(Default)]
    struct Fields<'a> {
        s: Option<&'a [u8]>,
        k: Option<&'a [u8]>,
        fp: Option<&'a [u8]>,
        op: Option<&'a [u8]>,
        st: Option<&'a [u8]>,
        tok: Option<&'a [u8]>,
        lu: Option<&'a [u8]>,
        ca: Option<&'a [u8]>,
        ea: Option<&'a [u8]>,
        co: Option<&'a [u8]>,
        sc: Option<&'a [u8]>,
        hd: Option<&'a [u8]>,
        bd: Option<&'a [u8]>,
    }
    let mut f = Fields::default();
    for pair in fields.chunks(2) {
        let [k, v] = pair else { continue };
        let (Some(k), Some(v)) = (bytes_of(k), bytes_of(v)) else {
            continue;
        };
        let slot = match k {
            b"s" => &mut f.s,
            b"k" => &mut f.k,
            b"fp" => &mut f.fp,
            b"op" => &mut f.op,
            b"st" => &mut f.st,
            b"tok" => &mut f.tok,
            b"lu" => &mut f.lu,
            b"ca" => &mut f.ca,
            b"ea" => &mut f.ea,
            b"co" => &mut f.co,
            b"sc" => &mut f.sc,
            b"hd" => &mut f.hd,
            b"bd" => &mut f.bd,
            _ => continue,
        };
        *slot = Some(v);
    }
    let text = |v: Option<&[u8]>| -> Option<String> {
        v.and_then(|b| std::str::from_utf8(b).ok())
            .map(str::to_owned)
    };
    let num = |v: Option<&[u8]>| -> Option<i64> {
        v.and_then(|b| std::str::from_utf8(b).ok())?.parse().ok()
    };
    let row = RecordRow {
        scope: text(f.s).ok_or_else(|| StoreError::Corrupt("the scope is missing".into()))?,
        key: text(f.k).ok_or_else(|| StoreError::Corrupt("the key is missing".into()))?,
        fingerprint: f.fp.map(<[u8]>::to_vec).unwrap_or_default(),
        operation_id: text(f.op).unwrap_or_default(),
        state: match f.st {
            Some(b"p") => "in_progress".to_owned(),
            Some(b"c") => "completed".to_owned(),
            other => format!("{:?}", other.map(String::from_utf8_lossy)),
        },
        token: num(f.tok),
        locked_until: num(f.lu),
        created_at: num(f.ca).ok_or_else(|| StoreError::Corrupt("created_at is missing".into()))?,
        expires_at: num(f.ea).ok_or_else(|| StoreError::Corrupt("expires_at is missing".into()))?,
        // (the hash layout predates it: not known)
        shortest_retention: None,
        completed_at: num(f.co),
        status: num(f.sc),
        headers: f.hd.map(<[u8]>::to_vec),
        body: f.bd.map(<[u8]>::to_vec),
    };
    Ok(row.into_record()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_out_of_range_is_corrupt_not_a_panic() {
        let time = |s: &str, us: &str| {
            Value::Array(vec![
                Value::BulkString(s.as_bytes().to_vec()),
                Value::BulkString(us.as_bytes().to_vec()),
            ])
        };
        assert_eq!(
            redis_time(&time("1700000000", "123456")).unwrap(),
            UnixMillis(1_700_000_000_123)
        );
        assert!(matches!(
            redis_time(&time("9223372036854775807", "0")),
            Err(StoreError::Corrupt(_))
        ));
        for (s, us) in [
            ("9223372036854775", "999999"),
            ("-1", "0"),
            ("1700000000", "1000000"),
            ("1700000000", "-1"),
        ] {
            assert!(
                matches!(redis_time(&time(s, us)), Err(StoreError::Corrupt(_))),
                "{s} {us}"
            );
        }
    }

    #[test]
    fn numbers_as_integers_or_their_digits() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        for (v, want) in [
            (Value::Int(-7), Some(-7)),
            (bulk("1700000000"), Some(1_700_000_000)),
            (bulk("-42"), Some(-42)),
            (Value::SimpleString("999999".into()), Some(999_999)),
            (bulk(""), None),
            (bulk("12a"), None),
            (bulk(" 1"), None),
            (bulk("99999999999999999999"), None),
            (Value::BulkString(vec![0xff, b'1']), None),
            (Value::Nil, None),
        ] {
            assert_eq!(number(Some(&v)).ok(), want, "{v:?}");
        }
        assert!(number(None).is_err());
    }

    fn field(k: &str, v: &str) -> [Value; 2] {
        [
            Value::BulkString(k.as_bytes().to_vec()),
            Value::BulkString(v.as_bytes().to_vec()),
        ]
    }

    /// A hash that lost its scope, its key or its state is corrupt, not a
    /// record of an empty scope or key.
    #[test]
    fn a_hash_missing_what_names_it_is_corrupt() {
        let whole = [
            field("s", "scope"),
            field("k", "key"),
            field("fp", &"f".repeat(32)),
            field("op", "00000000-0000-0000-0000-000000000001"),
            field("st", "p"),
            field("tok", "7"),
            field("lu", "10"),
            field("ca", "1"),
            field("ea", "100"),
        ];
        let flat = |skip: &str| -> Vec<Value> {
            whole
                .iter()
                .filter(|[k, _]| bytes_of(k) != Some(skip.as_bytes()))
                .flat_map(|pair| pair.iter().cloned())
                .collect()
        };
        assert!(decode(&flat("none")).is_ok());
        for missing in ["s", "k", "st", "ca"] {
            assert!(
                matches!(decode(&flat(missing)), Err(StoreError::Corrupt(_))),
                "{missing}"
            );
        }
    }
}
