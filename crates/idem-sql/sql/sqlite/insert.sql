-- A new key's claim, when the first look (get.sql) found no record: one
-- plain insert that commits by itself, on the writers' connection. It
-- fails on the primary key if any row holds the key (a claim that raced
-- this one, or a record past its retention waiting to be replaced), and
-- the claim's write transaction (claim.sql) then decides. Its times are
-- the database's clock as the insert runs (however long it queued for the
-- writers' connection), and it returns the lease it stored.
-- $1 scope, $2 key, $3 fingerprint, $4 operation id, $5 token,
-- $6 lease (ms), $7 retention (ms).
INSERT INTO {table}
    (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
         shortest_retention_ms)
VALUES ($1, $2, $3, $4, $5, 'in_progress', {now} + $6, {now}, {now} + $7, $7)
RETURNING locked_until
