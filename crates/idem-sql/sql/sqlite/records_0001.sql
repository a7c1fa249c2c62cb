-- idem's idempotency records. One row per (scope, key).
CREATE TABLE IF NOT EXISTS {table} (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    operation_id TEXT    NOT NULL,
    token        INTEGER NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    -- milliseconds since the Unix epoch
    locked_until INTEGER,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    completed_at INTEGER,
    status       INTEGER,
    headers      BLOB,
    body         BLOB,
    PRIMARY KEY (scope, key),
    CHECK ((state = 'in_progress') = (locked_until IS NOT NULL)),
    CHECK ((state = 'completed') = (status IS NOT NULL AND headers IS NOT NULL AND body IS NOT NULL))
);

-- The sweep reads expired records in expiry order.
CREATE INDEX IF NOT EXISTS "{name}_expires_at" ON {table} (expires_at);
