-- {table}: the quoted (database-qualified) table; {name}: its bare name,
-- which constraint and index names derive from.
-- The outbox: messages enqueued in the business transaction, published
-- by a relay after the commit. Ids and ordering keys are their bytes
-- (compared exactly, no collation); times in ms since the Unix epoch.
CREATE TABLE IF NOT EXISTS {table} (
    seq             BIGINT          NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id      VARBINARY(1020) NOT NULL,
    destination     TEXT            NOT NULL,
    ordering_key    VARBINARY(1020),
    payload         LONGBLOB        NOT NULL,
    headers         MEDIUMBLOB      NOT NULL,
    state           VARCHAR(8)      CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    attempts        INT             NOT NULL DEFAULT 0,
    next_attempt_at BIGINT          NOT NULL,
    claimed_until   BIGINT,
    claim_token     BIGINT,
    last_error      TEXT,
    created_at      BIGINT          NOT NULL,
    sent_at         BIGINT,
    CONSTRAINT `{name}_message_id_key` UNIQUE (message_id),
    INDEX `{name}_state_seq` (state, seq),
    INDEX `{name}_ordering` (ordering_key, state, seq),
    INDEX `{name}_claim_token` (claim_token),
    CONSTRAINT `{name}_state` CHECK (state IN ('pending', 'sent', 'dead'))
) ENGINE = InnoDB
