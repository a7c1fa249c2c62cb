//! [`TableName`]: where a table of idem's lives (the records, the outbox,
//! the inbox).

use std::fmt;

/// A (possibly schema-qualified) table name, validated and quoted, so that
/// two services can keep their records apart in one database.
///
/// ```
/// let t = idem_sql::TableName::new(Some("billing"), "idem_records").unwrap();
/// assert_eq!(t.qualified(), r#""billing"."idem_records""#);
/// assert!(idem_sql::TableName::new(None, "bad name; DROP TABLE x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

/// A schema or table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a valid identifier: use 1 to {max} letters, digits or underscores, not starting with a digit")]
pub struct InvalidIdentifier {
    name: String,
    max: usize,
}

/// PostgreSQL's longest identifier; a longer one is cut short silently.
const MAX_IDENTIFIER: usize = 63;

fn valid_identifier(s: &str) -> Result<(), InvalidIdentifier> {
    valid_identifier_of(s, MAX_IDENTIFIER)
}

fn valid_identifier_of(s: &str, max: usize) -> Result<(), InvalidIdentifier> {
    let ok = !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !s.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(InvalidIdentifier {
            name: s.to_owned(),
            max,
        })
    }
}

impl TableName {
    /// A table in `schema` (or, with `None`, wherever `search_path` finds it).
    pub fn new(schema: Option<&str>, table: &str) -> Result<Self, InvalidIdentifier> {
        if let Some(s) = schema {
            valid_identifier(s)?;
        }
        valid_identifier(table)?;
        Ok(Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// Like [`new`](Self::new), with the table's name at most `max` bytes:
    /// room for the suffixes of the constraint and index names derived
    /// from it (`{table}_message_id_key`), which must stay within
    /// PostgreSQL's 63 bytes to be matched by name.
    pub fn with_max_len(
        schema: Option<&str>,
        table: &str,
        max: usize,
    ) -> Result<Self, InvalidIdentifier> {
        valid_identifier_of(table, max.min(MAX_IDENTIFIER))?;
        Self::new(schema, table)
    }

    /// The quoted, qualified name for SQL.
    pub fn qualified(&self) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}\"", self.table),
            None => format!("\"{}\"", self.table),
        }
    }

    /// The schema, if one was given.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The bare table name.
    pub fn table(&self) -> &str {
        &self.table
    }
}

impl Default for TableName {
    /// `idem_records` (the idempotency records), found through
    /// `search_path`.
    fn default() -> Self {
        Self {
            schema: None,
            table: "idem_records".to_owned(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.qualified())
    }
}
