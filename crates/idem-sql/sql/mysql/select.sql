-- The record under a key, whatever its state, and the database's clock;
-- a locking read, so it sees the latest commit, not a snapshot.
-- $1 scope, $2 key.
SELECT CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`,
       fingerprint, operation_id, token, state, locked_until,
       created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms,
       {now} AS now
FROM {table} WHERE scope = $1 AND `key` = $2 FOR UPDATE
