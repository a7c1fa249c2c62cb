-- idem's idempotency records. One row per (scope, key).
-- {table} is the (optionally schema-qualified, quoted) table name; {name}
-- names its sweep index.
CREATE TABLE IF NOT EXISTS {table} (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL CHECK (length(fingerprint) = 32),
    operation_id uuid        NOT NULL,
    token        bigint      NOT NULL,
    state        text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    locked_until timestamptz,
    created_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    completed_at timestamptz,
    status       integer,
    headers      bytea,
    body         bytea,
    PRIMARY KEY (scope, key),
    CHECK ((state = 'in_progress') = (locked_until IS NOT NULL)),
    CHECK ((state = 'completed') = (status IS NOT NULL AND headers IS NOT NULL AND body IS NOT NULL))
);

-- The sweep reads expired records in expiry order, a bounded batch at a time.
CREATE INDEX IF NOT EXISTS "{name}_expires_at" ON {table} (expires_at);
