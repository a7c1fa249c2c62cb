-- The first look, one statement for the two common cases. A key never seen
-- is inserted (outcome 'new'). A record that answers the request without a
-- claim is read, and nothing is written or locked (outcome 'existing'): a
-- completed record (a replay, or 422 for another body), another request's
-- record (422), or a claim under a live lease (409). A completed record
-- never changes until it is past its retention, so a plain read answers it
-- as surely as a locking one would.
-- No row: the key's record is past its retention, or its lease ran out
-- (a takeover), or a concurrent insert committed after this statement's
-- snapshot; the deciding claim (claim.sql, claim_held.sql) runs.
-- $1 scope, $2 key, $3 fingerprint, $4 proposed operation id, $5 new token,
-- $6 lease (ms), $7 retention (ms).
WITH seen AS (
    SELECT * FROM {table} WHERE scope = $1 AND key = $2
),
inserted AS (
    INSERT INTO {table}
        (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
         shortest_retention_ms)
    SELECT $1, $2, $3, $4::uuid, $5, 'in_progress',
           now() + $6 * interval '1 millisecond', now(), now() + $7 * interval '1 millisecond', $7
    WHERE NOT EXISTS (SELECT 1 FROM seen)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING {columns}
)
SELECT 'new' AS outcome, * FROM inserted
UNION ALL
SELECT 'existing', {columns} FROM seen
WHERE expires_at > now()
  AND (state = 'completed' OR locked_until > now() OR fingerprint <> $3)
