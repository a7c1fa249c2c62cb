//! The one implementation of [`Dialect`](super::Dialect)'s I/O, as macros
//! instantiated in each database's module with its concrete types.

/// The one implementation of [`Dialect`]'s I/O, instantiated for each
/// database's concrete types (where sqlx's traits hold without the bounds
/// that generic code would have to spell out).
macro_rules! dialect_io {
    ($dialect:ty, $db:ty) => {
        fn execute<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            statement: &'e $crate::dialect::Statement<Self>,
            args: &'e [$crate::dialect::Arg<'e>],
        ) -> idem_core::BoxFuture<'e, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let query = bind(statement, args);
                Ok(query.execute(&mut *conn).await?.rows_affected())
            })
        }

        fn fetch_optional<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            statement: &'e $crate::dialect::Statement<Self>,
            args: &'e [$crate::dialect::Arg<'e>],
        ) -> idem_core::BoxFuture<'e, Result<Option<$crate::dialect::Row<Self>>, sqlx::Error>> {
            Box::pin(async move { bind(statement, args).fetch_optional(&mut *conn).await })
        }

        fn fetch_all<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            statement: &'e $crate::dialect::Statement<Self>,
            args: &'e [$crate::dialect::Arg<'e>],
        ) -> idem_core::BoxFuture<'e, Result<Vec<$crate::dialect::Row<Self>>, sqlx::Error>> {
            Box::pin(async move { bind(statement, args).fetch_all(&mut *conn).await })
        }

        fn run_script<'e>(
            conn: &'e mut $crate::dialect::Conn<Self>,
            script: &'e str,
        ) -> idem_core::BoxFuture<'e, Result<(), sqlx::Error>> {
            Box::pin(async move {
                // A `&str` runs as a script of several statements (the
                // simple / text protocol).
                sqlx::Executor::execute(&mut *conn, script).await?;
                Ok(())
            })
        }

        fn get<'r>(
            row: &'r $crate::dialect::Row<Self>,
            column: &str,
        ) -> Result<$crate::dialect::Value<'r>, sqlx::Error> {
            use sqlx::{Row as _, ValueRef as _};
            use $crate::dialect::Value;
            if row.try_get_raw(column)?.is_null() {
                return Ok(Value::Null);
            }
            if let Ok(v) = row.try_get::<i64, _>(column) {
                return Ok(Value::Int(v));
            }
            if let Ok(v) = row.try_get::<&str, _>(column) {
                return Ok(Value::Text(std::borrow::Cow::Borrowed(v)));
            }
            let v: &[u8] = row.try_get(column)?;
            Ok(Value::Bytes(std::borrow::Cow::Borrowed(v)))
        }

        fn columns(row: &$crate::dialect::Row<Self>) -> Vec<String> {
            use sqlx::{Column as _, Row as _};
            row.columns().iter().map(|c| c.name().to_owned()).collect()
        }

        fn decode_record(
            row: &$crate::dialect::Row<Self>,
        ) -> Result<idem_core::Record, idem_core::StoreError> {
            $crate::decode_record(row)
        }

        fn decode_stats(
            row: &$crate::dialect::Row<Self>,
            now: idem_core::UnixMillis,
        ) -> Result<idem_core::StoreStats, idem_core::StoreError> {
            $crate::decode_stats(row, now)
        }
    };
}
pub(crate) use dialect_io;

/// `fn bind`: `statement`'s query with `args` bound in its placeholder
/// order, for one database.
macro_rules! binder {
    ($dialect:ty, $db:ty) => {
        fn bind<'q>(
            statement: &'q $crate::dialect::Statement<$dialect>,
            args: &[$crate::dialect::Arg<'q>],
        ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>> {
            let mut query = sqlx::query(statement.sql());
            for arg in statement.bind_order(args) {
                query = match arg {
                    $crate::dialect::Arg::Text(s) => query.bind(s),
                    $crate::dialect::Arg::Int(i) => query.bind(i),
                    $crate::dialect::Arg::Bytes(b) => query.bind(b),
                    $crate::dialect::Arg::OptText(s) => query.bind(s),
                    $crate::dialect::Arg::Null => query.bind(None::<i64>),
                };
            }
            query
        }
    };
}
pub(crate) use binder;
