-- The record under a key, whatever its state, and the database's clock.
-- $1 scope, $2 key.
SELECT scope, key, fingerprint, operation_id, token, state, locked_until,
       created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms,
       {now} AS now
FROM {table} WHERE scope = $1 AND key = $2
