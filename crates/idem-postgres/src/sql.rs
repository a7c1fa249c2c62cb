//! The statements, from `sql/`, made into what runs on one table.

use crate::TableName;

/// The statements, with the table name filled in once.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) claim_first: String,
    pub(crate) claim: String,
    pub(crate) claim_held: String,
    pub(crate) hold: String,
    pub(crate) select: String,
    pub(crate) get: String,
    pub(crate) complete: String,
    pub(crate) release: String,
    pub(crate) sweep: String,
    pub(crate) stats: String,
}

/// Each statement's template, from `sql/` (read them there: a reviewer
/// sees the SQL as it runs, but for the table's name). `{table}` is the
/// qualified table, `{columns}` what a record is read from (`columns.sql`),
/// `{expired}` a record past its retention and not held under a live lease
/// (`expired.sql`).
const TEMPLATES: &[(&str, &str)] = &[
    ("claim_first", include_str!("../sql/claim_first.sql")),
    ("claim", include_str!("../sql/claim.sql")),
    ("claim_held", include_str!("../sql/claim_held.sql")),
    ("hold", include_str!("../sql/hold.sql")),
    ("select", include_str!("../sql/select.sql")),
    ("get", include_str!("../sql/get.sql")),
    ("complete", include_str!("../sql/complete.sql")),
    ("release", include_str!("../sql/release.sql")),
    ("sweep", include_str!("../sql/sweep.sql")),
    ("stats", include_str!("../sql/stats.sql")),
];

const COLUMNS: &str = include_str!("../sql/columns.sql");
const EXPIRED: &str = include_str!("../sql/expired.sql");

/// A template from `sql/` made into the statement that runs on `table`.
fn render(template: &str, table: &TableName) -> String {
    template
        .replace("{columns}", COLUMNS.trim())
        .replace("{expired}", EXPIRED.trim())
        .replace("{table}", &table.qualified())
}

fn template(name: &str) -> &'static str {
    TEMPLATES
        .iter()
        .find(|(n, _)| *n == name)
        .map_or("", |(_, sql)| sql)
}

impl Sql {
    pub(crate) fn new(t: &TableName) -> Self {
        let sql = |name: &str| render(template(name), t);
        Self {
            claim_first: sql("claim_first"),
            claim: sql("claim"),
            claim_held: sql("claim_held"),
            hold: sql("hold"),
            select: sql("select"),
            get: sql("get"),
            complete: sql("complete"),
            release: sql("release"),
            sweep: sql("sweep"),
            stats: sql("stats"),
        }
    }
}

pub(crate) fn complete_sql(t: &TableName) -> String {
    render(template("complete"), t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prints every statement as it runs on a schema-qualified table (see
    /// them with `cargo test -p idem-postgres finished_statements --
    /// --nocapture`), and checks that nothing is left unfilled.
    #[test]
    fn finished_statements() {
        let table = TableName::new(Some("app"), "idem_records").unwrap_or_default();
        for (name, template) in TEMPLATES {
            let sql = render(template, &table);
            println!("-- {name}.sql\n{sql}\n");
            assert!(!sql.contains('{') && !sql.contains('}'), "{name}: {sql}");
            assert!(sql.contains("\"app\".\"idem_records\""), "{name}");
        }
        let sql = Sql::new(&table);
        assert!(sql.claim_held.contains("FOR UPDATE SKIP LOCKED"));
        assert!(sql.get.contains("NOT (expires_at <= now()"));
    }
}
