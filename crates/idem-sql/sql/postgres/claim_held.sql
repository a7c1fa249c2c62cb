-- The deciding claim of a transaction-held claim (autocommit, when the
-- first look did not decide). Such a claim commits with its lease already run
-- out (bound $6 = 0): the holder's transaction, which locks the row
-- (hold.sql), is its lease. So a row is free to the same request only if no
-- transaction holds its lock (SKIP LOCKED) and its lease has run out: its
-- holder's transaction ended without completing it (rolled back, or died
-- with its connection), or it is a default-mode claim whose lease ended (a
-- live one is busy). Another request's live claim or a live completed
-- record is `existing` (422 or a replay); past its retention and
-- abandoned, a record is replaced whole. A takeover keeps the record for at
-- least another retention. Same binds as claim_first.sql.
WITH free AS MATERIALIZED (
    SELECT scope AS free_scope, key AS free_key FROM {table}
    WHERE scope = $1 AND key = $2
      AND ((state = 'in_progress' AND locked_until <= now() AND fingerprint = $3)
           OR {expired})
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE {table} AS r SET
        token        = $5,
        state        = 'in_progress',
        locked_until = now() + $6 * interval '1 millisecond',
        -- past its retention the record is replaced whole; a takeover keeps it
        fingerprint  = CASE WHEN r.expires_at <= now() THEN $3          ELSE r.fingerprint  END,
        operation_id = CASE WHEN r.expires_at <= now() THEN $4::uuid    ELSE r.operation_id END,
        created_at   = CASE WHEN r.expires_at <= now() THEN now()       ELSE r.created_at   END,
        expires_at   = greatest(r.expires_at, now() + $7 * interval '1 millisecond'),
        shortest_retention_ms = CASE
            WHEN r.expires_at <= now() THEN $7
            WHEN r.shortest_retention_ms IS NULL THEN NULL
            ELSE least(r.shortest_retention_ms, $7) END,
        completed_at = NULL,
        status       = NULL,
        headers      = NULL,
        body         = NULL
    FROM free
    WHERE r.scope = free.free_scope AND r.key = free.free_key
    RETURNING {columns}
),
live_other AS (
    -- a live completed record, or another request's claim
    SELECT {columns} FROM {table}
    WHERE scope = $1 AND key = $2 AND expires_at > now()
      AND (state = 'completed' OR fingerprint <> $3)
)
SELECT 'won' AS outcome, * FROM claimed
UNION ALL
SELECT 'existing', * FROM live_other WHERE NOT EXISTS (SELECT 1 FROM claimed)
UNION ALL
SELECT 'busy', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM {table}
WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)
  AND NOT EXISTS (SELECT 1 FROM live_other)
