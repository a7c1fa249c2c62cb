-- The claim, in one statement, under the write transaction's lock. It
-- inserts a new record, replaces one past its retention, or takes over an
-- expired or released lease of the same request; otherwise it changes
-- nothing. The caller reads the row back (select.sql): its token is the
-- caller's exactly when the caller won.
-- $1 scope, $2 key, $3 fingerprint, $4 proposed operation id, $5 new
-- token, $6 lease (ms), $7 retention (ms).
INSERT INTO {table}
    (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
         shortest_retention_ms)
VALUES ($1, $2, $3, $4, $5, 'in_progress', {now} + $6, {now}, {now} + $7, $7)
ON CONFLICT (scope, key) DO UPDATE SET
    token        = excluded.token,
    locked_until = excluded.locked_until,
    state        = 'in_progress',
    -- past its retention the record is replaced whole; a takeover keeps it,
    -- for at least another retention (an answer it completes late is kept)
    fingerprint  = iif({table}.expires_at <= {now}, excluded.fingerprint,  {table}.fingerprint),
    operation_id = iif({table}.expires_at <= {now}, excluded.operation_id, {table}.operation_id),
    created_at   = iif({table}.expires_at <= {now}, excluded.created_at,   {table}.created_at),
    expires_at   = max({table}.expires_at, excluded.expires_at),
    -- the shortest retention any claim asked for (min() of a NULL, a row
    -- written before the column, stays NULL: not known)
    shortest_retention_ms = iif({table}.expires_at <= {now}, excluded.shortest_retention_ms,
                                min({table}.shortest_retention_ms, excluded.shortest_retention_ms)),
    completed_at = NULL,
    status       = NULL,
    headers      = NULL,
    body         = NULL
WHERE
    -- past its retention, and not held under a live lease
    ({table}.expires_at <= {now}
        AND ({table}.state = 'completed' OR {table}.locked_until <= {now}))
    -- or an expired or released lease of the same request: take it over
    OR ({table}.state = 'in_progress'
        AND {table}.locked_until <= {now}
        AND {table}.fingerprint = excluded.fingerprint)
