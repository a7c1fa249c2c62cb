//! [`Db`]: the database an outbox or inbox lives in, whichever driver.

/// The database an outbox or an inbox lives in: a PostgreSQL or SQLite
/// pool (each behind its crate feature, `postgres` / `sqlite`). Every
/// function that takes `impl Into<Db>` takes `&pool` of either, so one name
/// serves both: `outbox::migrate(&pool)`, `inbox::migrate(&pool)`,
/// `Relay::new(pool, …)`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Db {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
}

#[cfg(feature = "postgres")]
impl From<sqlx::PgPool> for Db {
    fn from(pool: sqlx::PgPool) -> Self {
        Self::Postgres(pool)
    }
}

#[cfg(feature = "postgres")]
impl From<&sqlx::PgPool> for Db {
    fn from(pool: &sqlx::PgPool) -> Self {
        Self::Postgres(pool.clone())
    }
}

#[cfg(feature = "sqlite")]
impl From<sqlx::SqlitePool> for Db {
    fn from(pool: sqlx::SqlitePool) -> Self {
        Self::Sqlite(pool)
    }
}

#[cfg(feature = "sqlite")]
impl From<&sqlx::SqlitePool> for Db {
    fn from(pool: &sqlx::SqlitePool) -> Self {
        Self::Sqlite(pool.clone())
    }
}

/// The bare name a SQLite table is written with: SQLite keeps no schemas
/// (its "schemas" are attached database files), so a schema-qualified
/// table is refused there rather than silently put somewhere else.
#[cfg(feature = "sqlite")]
pub(crate) fn sqlite_table(name: &idem_sql::TableName) -> Result<String, sqlx::Error> {
    match name.schema() {
        None => Ok(name.qualified()),
        Some(schema) => Err(sqlx::Error::Configuration(
            format!(
                "table {name}: SQLite has no schemas (schema {schema:?} given); \
                 name the table alone (TableName::new(None, …))"
            )
            .into(),
        )),
    }
}

/// `sql` with `{table}` filled in with `name` as PostgreSQL (`postgres`)
/// or SQLite writes it.
pub(crate) fn render(
    name: &idem_sql::TableName,
    sql: &str,
    postgres: bool,
) -> Result<String, sqlx::Error> {
    let table = if postgres {
        name.qualified()
    } else {
        #[cfg(feature = "sqlite")]
        {
            sqlite_table(name)?
        }
        #[cfg(not(feature = "sqlite"))]
        {
            name.qualified()
        }
    };
    Ok(sql.replace("{table}", &table))
}

/// Creates or upgrades table `name` with its database's migrations.
pub(crate) async fn migrate(
    db: Db,
    name: &idem_sql::TableName,
    postgres: &[idem_sql::migrate::Migration],
    sqlite: &[idem_sql::migrate::Migration],
) -> Result<(), sqlx::Error> {
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres(pool) => {
            idem_sql::migrate::migrate::<idem_sql::Postgres>(&pool, name, postgres)
                .await
                .map_err(migrate_error)
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite(pool) => {
            sqlite_table(name)?;
            idem_sql::migrate::migrate::<idem_sql::Sqlite>(&pool, name, sqlite)
                .await
                .map_err(migrate_error)
        }
    }
}

/// Whether `e` says the table does not exist: PostgreSQL's
/// `undefined_table` (42P01), SQLite's "no such table".
pub(crate) fn is_missing_table(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.code().as_deref() == Some("42P01") || d.message().starts_with("no such table")
        }
        _ => false,
    }
}

fn migrate_error(e: idem_sql::MigrateError) -> sqlx::Error {
    match e {
        idem_sql::MigrateError::Database { source, .. } => source,
        other => sqlx::Error::Configuration(Box::new(other)),
    }
}
