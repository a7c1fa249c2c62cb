-- The deciding claim, when the first look did not decide: insert the row,
-- or take over an expired or released one (see the crate docs for why this
-- is safe under READ COMMITTED); the loser reads the record that beat it. Same binds as claim_first.sql.
-- The row's lock is waited for at most 2 s (lock_timeout, set for this
-- statement's own transaction before the insert meets the row): a claim
-- runs in milliseconds, so a longer wait is a transaction that holds the
-- row (a handler past its lease that already completed the record in its
-- business transaction): the claim fails (55P03, the store unavailable
-- for now: 503 and Retry-After) rather than holding its connection, and a
-- place in the row's queue, for as long as that transaction lasts.
WITH claimed AS (
    INSERT INTO {table} AS r
        (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
         shortest_retention_ms)
    SELECT $1, $2, $3, $4::uuid, $5, 'in_progress',
           now() + $6 * interval '1 millisecond', now(), now() + $7 * interval '1 millisecond', $7
    WHERE set_config('lock_timeout', '2000', true) IS NOT NULL
    ON CONFLICT (scope, key) DO UPDATE SET
        token        = excluded.token,
        locked_until = excluded.locked_until,
        state        = 'in_progress',
        -- past its retention the record is replaced whole; a takeover keeps
        -- it, for at least another retention (so that an answer the
        -- takeover completes late is still kept: a retry after it must not
        -- find the key new, and run again under a new operation id)
        fingerprint  = CASE WHEN r.expires_at <= now() THEN excluded.fingerprint  ELSE r.fingerprint  END,
        operation_id = CASE WHEN r.expires_at <= now() THEN excluded.operation_id ELSE r.operation_id END,
        created_at   = CASE WHEN r.expires_at <= now() THEN excluded.created_at   ELSE r.created_at   END,
        expires_at   = greatest(r.expires_at, excluded.expires_at),
        -- the shortest retention any claim asked for (unknown stays unknown:
        -- a row an idem before the column wrote)
        shortest_retention_ms = CASE
            WHEN r.expires_at <= now() THEN excluded.shortest_retention_ms
            WHEN r.shortest_retention_ms IS NULL THEN NULL
            ELSE least(r.shortest_retention_ms, excluded.shortest_retention_ms) END,
        completed_at = NULL,
        status       = NULL,
        headers      = NULL,
        body         = NULL
    WHERE
        -- past its retention, and not held under a live lease (expired.sql,
        -- spelled with the row's alias: `excluded` has the same columns)
        (r.expires_at <= now() AND (r.state = 'completed' OR r.locked_until <= now()))
        -- or an expired or released lease of the same request: take it over
        OR (r.state = 'in_progress' AND r.locked_until <= now() AND r.fingerprint = excluded.fingerprint)
    RETURNING {columns}
)
SELECT true AS won, * FROM claimed
UNION ALL
-- The loser's answer is read from the statement's snapshot, which can be
-- older than the row the upsert judged (its WHERE sees the latest version):
-- a version the WHERE would have claimed (past its retention, or a lease
-- of this request run out) was replaced after the snapshot by the winner,
-- so it is not the answer. No row then, and the store runs the statement
-- again on a fresh snapshot.
SELECT false AS won, {columns} FROM {table}
WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claimed)
  AND NOT {expired}
  AND NOT (state = 'in_progress' AND locked_until <= now() AND fingerprint = $3)
