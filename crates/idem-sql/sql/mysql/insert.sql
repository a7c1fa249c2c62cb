-- A new key's claim, when the first look (first.sql) found no record: one
-- plain insert that commits by itself. It fails on the primary key if any
-- row holds the key (a claim that raced this one, or a record past its
-- retention waiting to be replaced), and the claim's write transaction
-- (claim.sql) then decides. Its times are the first look's clock, so the
-- lease the caller reports is the one stored (and begins, if anything, a
-- little before the row was written).
-- $1 scope, $2 key, $3 fingerprint, $4 operation id, $5 token,
-- $6 locked_until, $7 created_at, $8 expires_at (ms of the database's clock),
-- $9 the retention (ms).
INSERT INTO {table}
    (scope, `key`, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
     shortest_retention_ms)
VALUES ($1, $2, $3, $4, $5, 'in_progress', $6, $7, $8, $9)
