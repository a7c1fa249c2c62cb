//! Reading what the scripts return: a stored record from its hash, and
//! the fields of a reply.

use idem_core::{OperationId, Record, RecordRow, StoreError};
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
        other => text(other)?
            .parse()
            .map_err(|_| StoreError::Corrupt("expected a number in a script reply".into())),
    }
}

pub(crate) fn parse_op(s: &str) -> Result<OperationId, StoreError> {
    uuid::Uuid::parse_str(s)
        .map(OperationId)
        .map_err(|e| StoreError::Corrupt(format!("operation id {s:?}: {e}")))
}

/// Decodes a record from a flat `field, value, …` list (HGETALL).
pub(crate) fn decode(fields: &[Value]) -> Result<Record, StoreError> {
    let mut get = std::collections::HashMap::new();
    for pair in fields.chunks(2) {
        if let [k, v] = pair {
            if let (Some(k), Some(v)) = (bytes_of(k), bytes_of(v)) {
                get.insert(k.to_vec(), v.to_vec());
            }
        }
    }
    let bytes = |name: &str| get.get(name.as_bytes()).cloned();
    let text =
        |name: &str| -> Option<String> { bytes(name).and_then(|b| String::from_utf8(b).ok()) };
    let num = |name: &str| -> Option<i64> { text(name)?.parse().ok() };
    let row = RecordRow {
        scope: text("s").ok_or_else(|| StoreError::Corrupt("the scope is missing".into()))?,
        key: text("k").ok_or_else(|| StoreError::Corrupt("the key is missing".into()))?,
        fingerprint: bytes("fp").unwrap_or_default(),
        operation_id: text("op").unwrap_or_default(),
        state: match text("st").as_deref() {
            Some("p") => "in_progress".to_owned(),
            Some("c") => "completed".to_owned(),
            other => format!("{other:?}"),
        },
        token: num("tok"),
        locked_until: num("lu"),
        created_at: num("ca").ok_or_else(|| StoreError::Corrupt("created_at is missing".into()))?,
        expires_at: num("ea").ok_or_else(|| StoreError::Corrupt("expires_at is missing".into()))?,
        completed_at: num("co"),
        status: num("sc"),
        headers: bytes("hd"),
        body: bytes("bd"),
    };
    Ok(row.into_record()?)
}

#[cfg(test)]
mod tests {
    use super::*;

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
