-- {table}: the quoted (on PostgreSQL, schema-qualified) table; {name}: its
-- bare name, which constraint and index names derive from.
-- The outbox: messages enqueued in the business transaction, published
-- by a relay after the commit.
CREATE TABLE IF NOT EXISTS {table} (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id      TEXT    NOT NULL CONSTRAINT "{name}_message_id_key" UNIQUE,
    destination     TEXT    NOT NULL,
    ordering_key    TEXT,
    payload         BLOB    NOT NULL,
    headers         BLOB    NOT NULL,
    state           TEXT    NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'dead')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL DEFAULT 0,
    claimed_until   INTEGER,
    claim_token     INTEGER,
    last_error      TEXT,
    created_at      INTEGER NOT NULL,
    sent_at         INTEGER
);
CREATE INDEX IF NOT EXISTS "{name}_state_seq" ON {table} (state, seq);
