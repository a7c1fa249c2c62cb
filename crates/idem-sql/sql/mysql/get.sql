-- The record under a key, unless it is past its retention, and the
-- database's clock. $1 scope, $2 key.
SELECT CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`,
       fingerprint, operation_id, token, state, locked_until,
       created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms,
       {now} AS now
FROM {table} WHERE scope = $1 AND `key` = $2
  AND NOT (expires_at <= {now} AND (state = 'completed' OR locked_until <= {now}))
