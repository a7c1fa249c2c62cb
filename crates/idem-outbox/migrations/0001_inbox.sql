-- The inbox: one row per processed message, inserted in the handler's
-- transaction; its primary key is what makes a redelivery a duplicate.
CREATE TABLE IF NOT EXISTS idem_inbox (
    consumer     TEXT   NOT NULL,
    message_id   TEXT   NOT NULL,
    processed_at BIGINT NOT NULL,
    CONSTRAINT idem_inbox_pkey PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS idem_inbox_processed_at ON idem_inbox (processed_at);
