-- The claim, in one statement, inside the write transaction. InnoDB has no
-- RETURNING: the caller reads the row back with a locking read
-- (select_locked.sql; the insert or update holds its lock already) and won
-- exactly when the token there is its own. Inserting first, never a
-- `SELECT … FOR UPDATE` of a missing row, which would take a gap lock.
-- Assignments run left to right, each seeing the ones before: the first
-- decides (into `token`), the rest follow from it. Past its retention the
-- record is replaced whole; a takeover keeps its fingerprint and operation
-- id, and the record for at least another retention (an answer the
-- takeover completes late is kept).
-- $1 scope, $2 key, $3 fingerprint, $4 proposed operation id, $5 new
-- token, $6 lease (ms), $7 retention (ms).
INSERT INTO {table}
    (scope, `key`, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
     shortest_retention_ms)
VALUES ($1, $2, $3, $4, $5, 'in_progress', {now} + $6, {now}, {now} + $7, $7)
ON DUPLICATE KEY UPDATE
    token        = IF((expires_at <= {now} AND (state = 'completed' OR locked_until <= {now}))
                      OR (state = 'in_progress' AND locked_until <= {now}
                          AND fingerprint = VALUES(fingerprint)),
                      VALUES(token), token),
    fingerprint  = IF(token = VALUES(token) AND expires_at <= {now}, VALUES(fingerprint),  fingerprint),
    operation_id = IF(token = VALUES(token) AND expires_at <= {now}, VALUES(operation_id), operation_id),
    created_at   = IF(token = VALUES(token) AND expires_at <= {now}, VALUES(created_at),   created_at),
    -- before expires_at changes: the shortest retention any claim asked for
    -- (LEAST of a NULL, a row written before the column, stays NULL)
    shortest_retention_ms = IF(token = VALUES(token),
                               IF(expires_at <= {now}, VALUES(shortest_retention_ms),
                                  LEAST(shortest_retention_ms, VALUES(shortest_retention_ms))),
                               shortest_retention_ms),
    expires_at   = IF(token = VALUES(token), GREATEST(expires_at, VALUES(expires_at)), expires_at),
    state        = IF(token = VALUES(token), 'in_progress',        state),
    locked_until = IF(token = VALUES(token), VALUES(locked_until), locked_until),
    completed_at = IF(token = VALUES(token), NULL, completed_at),
    status       = IF(token = VALUES(token), NULL, status),
    headers      = IF(token = VALUES(token), NULL, headers),
    body         = IF(token = VALUES(token), NULL, body)
