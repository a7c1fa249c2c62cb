-- idem's idempotency records. One row per (scope, key). Times in
-- milliseconds since the Unix epoch (the database's clock, in UTC). Scope
-- and key are their UTF-8 bytes, compared byte for byte (no collation: no
-- case folding, no trailing-space padding), and fit InnoDB's 3072-byte
-- index limit together.
CREATE TABLE IF NOT EXISTS {table} (
    scope        VARBINARY(2048) NOT NULL,
    `key`        VARBINARY(1020) NOT NULL,
    fingerprint  BINARY(32)  NOT NULL,
    operation_id CHAR(36)    CHARACTER SET ascii NOT NULL,
    token        BIGINT      NOT NULL,
    state        VARCHAR(16) CHARACTER SET ascii NOT NULL,
    locked_until BIGINT,
    created_at   BIGINT      NOT NULL,
    expires_at   BIGINT      NOT NULL,
    completed_at BIGINT,
    status       INT,
    headers      MEDIUMBLOB,
    body         LONGBLOB,
    PRIMARY KEY (scope, `key`),
    -- the sweep reads expired records in expiry order
    INDEX `{name}_expires_at` (expires_at),
    CONSTRAINT `{name}_state` CHECK (state IN ('in_progress', 'completed')),
    CONSTRAINT `{name}_lease` CHECK ((state = 'in_progress') = (locked_until IS NOT NULL)),
    CONSTRAINT `{name}_response` CHECK ((state = 'completed') = (status IS NOT NULL AND headers IS NOT NULL AND body IS NOT NULL))
) ENGINE = InnoDB
