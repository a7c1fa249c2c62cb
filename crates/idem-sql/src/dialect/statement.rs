//! [`Statement`]: SQL made for one database; [`Value`]: a column read back.

use std::borrow::Cow;

use super::{Arg, Dialect};
use crate::TableName;

/// A column's value, read by [`Dialect::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Value<'r> {
    /// `NULL`.
    Null,
    /// An integer.
    Int(i64),
    /// Text.
    Text(Cow<'r, str>),
    /// Bytes.
    Bytes(Cow<'r, [u8]>),
}

impl Value<'_> {
    /// The value, owning what it borrowed from its row.
    pub fn into_owned(self) -> Value<'static> {
        match self {
            Value::Null => Value::Null,
            Value::Int(i) => Value::Int(i),
            Value::Text(s) => Value::Text(Cow::Owned(s.into_owned())),
            Value::Bytes(b) => Value::Bytes(Cow::Owned(b.into_owned())),
        }
    }

    /// The integer, or an error naming `column`.
    pub fn int(&self, column: &str) -> Result<i64, sqlx::Error> {
        match self {
            Value::Int(v) => Ok(*v),
            other => Err(mismatch(column, "an integer", other)),
        }
    }

    /// The integer, `None` for `NULL`.
    pub fn opt_int(&self, column: &str) -> Result<Option<i64>, sqlx::Error> {
        match self {
            Value::Null => Ok(None),
            other => other.int(column).map(Some),
        }
    }

    /// The text (bytes that are UTF-8 pass too), or an error naming
    /// `column`.
    pub fn text(&self, column: &str) -> Result<String, sqlx::Error> {
        match self {
            Value::Text(s) => Ok(s.clone().into_owned()),
            Value::Bytes(b) => {
                String::from_utf8(b.to_vec()).map_err(|_| mismatch(column, "UTF-8 text", self))
            }
            other => Err(mismatch(column, "text", other)),
        }
    }

    /// The bytes (text passes too), or an error naming `column`.
    pub fn bytes(&self, column: &str) -> Result<Vec<u8>, sqlx::Error> {
        match self {
            Value::Bytes(b) => Ok(b.to_vec()),
            Value::Text(s) => Ok(s.as_bytes().to_vec()),
            other => Err(mismatch(column, "bytes", other)),
        }
    }

    /// The bytes, `None` for `NULL`.
    pub fn opt_bytes(&self, column: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
        match self {
            Value::Null => Ok(None),
            other => other.bytes(column).map(Some),
        }
    }
}

fn mismatch(column: &str, wanted: &str, got: &Value<'_>) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: format!("expected {wanted}, found {got:?}").into(),
    }
}

/// A statement made for one database and one table: the text as it runs,
/// and which argument each placeholder takes.
#[derive(Debug, Clone)]
pub struct Statement<D> {
    sql: String,
    // For each placeholder in the text, in order, the argument (from 0).
    order: Box<[usize]>,
    dialect: D,
}

impl<D: Dialect> Statement<D> {
    /// Makes `template` into a statement on `table`: `{table}` becomes the
    /// qualified table ([`Dialect::qualify`]), `{name}` its bare name,
    /// `{now}` the clock ([`Dialect::NOW_MILLIS`]), `{skip_locked}`
    /// [`Dialect::SKIP_LOCKED`], and `$1`, `$2`, … the database's own
    /// placeholders. Fails only when the table cannot live on this
    /// database (a schema on SQLite).
    pub fn prepare(template: &str, table: &TableName) -> Result<Self, sqlx::Error> {
        let filled = template
            .replace("{table}", &D::qualify(table)?)
            .replace("{name}", table.table())
            .replace("{now}", D::NOW_MILLIS)
            .replace("{skip_locked}", D::SKIP_LOCKED);
        Ok(Self::placeholders(&filled))
    }

    /// `sql` (no named parts) with its `$n` placeholders made the
    /// database's own.
    pub fn raw(sql: &str) -> Self {
        Self::placeholders(sql)
    }

    fn placeholders(text: &str) -> Self {
        let mut sql = String::with_capacity(text.len());
        let mut order = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find(['$', '\'', '-']) {
            sql.push_str(&rest[..at]);
            let (head, after) = rest[at..].split_at(1);
            rest = match head {
                // A `--` comment runs to the end of its line: dropped, so a
                // `$1` in it is no placeholder (MySQL counts none there).
                "-" if after.starts_with('-') => after.find('\n').map_or("", |n| &after[n..]),
                // A string literal is copied as it is.
                "'" => {
                    let end = after.find('\'').map_or(after.len(), |n| n + 1);
                    sql.push('\'');
                    sql.push_str(&after[..end]);
                    &after[end..]
                }
                "$" => {
                    let digits = after.bytes().take_while(u8::is_ascii_digit).count();
                    match after[..digits].parse::<usize>() {
                        Ok(n) if n > 0 => {
                            sql.push_str(&D::placeholder(n));
                            order.push(n - 1);
                        }
                        _ => sql.push('$'),
                    }
                    &after[digits..]
                }
                other => {
                    sql.push_str(other);
                    after
                }
            };
        }
        sql.push_str(rest);
        if D::NUMBERED {
            let count = order.iter().max().map_or(0, |max| max + 1);
            order = (0..count).collect();
        }
        Self {
            sql,
            order: order.into_boxed_slice(),
            dialect: D::default(),
        }
    }

    /// The text, as it runs.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The arguments in the order the placeholders take them.
    pub fn bind_order<'a, 'b>(&'b self, args: &'b [Arg<'a>]) -> impl Iterator<Item = Arg<'a>> + 'b {
        let _ = self.dialect;
        self.order
            .iter()
            .map(move |&i| args.get(i).copied().unwrap_or(Arg::Null))
    }
}
