-- The claim, in one statement. Parameters: ?1 scope, ?2 key, ?3 fingerprint,
-- ?4 proposed operation id, ?5 new token, ?6 locked_until, ?7 now,
-- ?8 expires_at. Returns the record's operation id when the caller won:
-- the proposed one for a fresh claim, the kept one for a takeover.
INSERT INTO idem_records
    (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at)
VALUES (?1, ?2, ?3, ?4, ?5, 'in_progress', ?6, ?7, ?8)
ON CONFLICT (scope, key) DO UPDATE SET
    token        = excluded.token,
    locked_until = excluded.locked_until,
    state        = 'in_progress',
    -- past its retention the record is replaced whole; a takeover keeps it
    fingerprint  = iif(idem_records.expires_at <= ?7, excluded.fingerprint,  idem_records.fingerprint),
    operation_id = iif(idem_records.expires_at <= ?7, excluded.operation_id, idem_records.operation_id),
    created_at   = iif(idem_records.expires_at <= ?7, excluded.created_at,   idem_records.created_at),
    expires_at   = iif(idem_records.expires_at <= ?7, excluded.expires_at,   idem_records.expires_at),
    completed_at = NULL,
    status       = NULL,
    headers      = NULL,
    body         = NULL
WHERE
    -- past its retention, and not held under a live lease
    (idem_records.expires_at <= ?7
        AND (idem_records.state = 'completed' OR idem_records.locked_until <= ?7))
    -- or an expired or released lease of the same request: take it over
    OR (idem_records.state = 'in_progress'
        AND idem_records.locked_until <= ?7
        AND idem_records.fingerprint = excluded.fingerprint)
RETURNING operation_id
