-- {table}: the quoted (database-qualified) table; {name}: its bare name.
-- The inbox: one row per processed message, inserted in the handler's
-- transaction; its primary key is what makes a redelivery a duplicate.
-- Consumer and message id are their bytes, compared exactly.
CREATE TABLE IF NOT EXISTS {table} (
    consumer     VARBINARY(255)  NOT NULL,
    message_id   VARBINARY(1020) NOT NULL,
    processed_at BIGINT          NOT NULL,
    PRIMARY KEY (consumer, message_id),
    INDEX `{name}_processed_at` (processed_at)
) ENGINE = InnoDB
