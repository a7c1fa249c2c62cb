-- The common case, a key never seen: a plain insert. It returns no row on
-- any conflict, and the deciding claim (claim.sql, claim_held.sql) runs.
-- $1 scope, $2 key, $3 fingerprint, $4 proposed operation id, $5 new token,
-- $6 lease (ms), $7 retention (ms).
INSERT INTO {table}
    (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at)
VALUES ($1, $2, $3, $4::uuid, $5, 'in_progress',
        now() + $6 * interval '1 millisecond', now(), now() + $7 * interval '1 millisecond')
ON CONFLICT (scope, key) DO NOTHING
RETURNING (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until
