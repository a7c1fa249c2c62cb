-- {table}: the quoted (on PostgreSQL, schema-qualified) table; {name}: its
-- bare name, which constraint and index names derive from.
-- The outbox: messages enqueued in the business transaction, published
-- by a relay after the commit.
CREATE TABLE IF NOT EXISTS {table} (
    seq             BIGSERIAL   PRIMARY KEY,
    message_id      TEXT        NOT NULL CONSTRAINT "{name}_message_id_key" UNIQUE,
    destination     TEXT        NOT NULL,
    ordering_key    TEXT,
    payload         BYTEA       NOT NULL,
    headers         BYTEA       NOT NULL,
    state           TEXT        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'dead')),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    claimed_until   TIMESTAMPTZ,
    claim_token     BIGINT,
    last_error      TEXT,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at         TIMESTAMPTZ
);
CREATE INDEX IF NOT EXISTS "{name}_pending" ON {table} (seq) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS "{name}_ordering" ON {table} (ordering_key, seq) WHERE state = 'pending';
