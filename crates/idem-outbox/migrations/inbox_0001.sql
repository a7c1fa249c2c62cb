-- {table}: the quoted (on PostgreSQL, schema-qualified) table; {name}: its
-- bare name, which constraint and index names derive from.
-- The inbox: one row per processed message, inserted in the handler's
-- transaction; its primary key is what makes a redelivery a duplicate.
CREATE TABLE IF NOT EXISTS {table} (
    consumer     TEXT   NOT NULL,
    message_id   TEXT   NOT NULL,
    processed_at BIGINT NOT NULL,
    CONSTRAINT "{name}_pkey" PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS "{name}_processed_at" ON {table} (processed_at);
