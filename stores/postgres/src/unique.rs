//! Unique violations as answers: telling "this natural key already exists"
//! from every other failure.

/// A unique violation (SQLSTATE `23505`), with the constraint it hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateKey {
    /// The violated constraint (or unique index) name.
    pub constraint: String,
    /// The table, when PostgreSQL reports it.
    pub table: Option<String>,
}

impl DuplicateKey {
    /// The unique violation inside `e`, if that is what it is.
    pub fn of(e: &sqlx::Error) -> Option<Self> {
        let sqlx::Error::Database(db) = e else {
            return None;
        };
        if db.code().as_deref() != Some("23505") {
            return None;
        }
        Some(Self {
            constraint: db.constraint()?.to_owned(),
            table: db.table().map(str::to_owned),
        })
    }
}

/// The outcome of a write guarded by a unique constraint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inserted<T> {
    /// The write went through.
    New(T),
    /// The expected constraint said the natural key exists already.
    Duplicate(DuplicateKey),
}

/// Turns a unique violation of **`constraint`** into
/// [`Inserted::Duplicate`]; passes every other error through, including
/// unique violations of other constraints (those are real failures).
///
/// ```no_run
/// use idem_postgres::{insert_unique, Inserted};
/// # async fn f(pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// let result = sqlx::query("INSERT INTO orders (order_ref) VALUES ($1)")
///     .bind("ord-42")
///     .execute(&pool)
///     .await;
/// match insert_unique(result, "orders_order_ref_key")? {
///     Inserted::New(_) => println!("created"),
///     Inserted::Duplicate(d) => println!("exists already ({})", d.constraint),
/// }
/// # Ok(()) }
/// ```
pub fn insert_unique<T>(
    result: Result<T, sqlx::Error>,
    constraint: &str,
) -> Result<Inserted<T>, sqlx::Error> {
    match result {
        Ok(v) => Ok(Inserted::New(v)),
        Err(e) => match DuplicateKey::of(&e) {
            Some(d) if d.constraint == constraint => Ok(Inserted::Duplicate(d)),
            _ => Err(e),
        },
    }
}
