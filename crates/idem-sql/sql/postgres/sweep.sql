-- Removes at most $1 records past their retention, skipping rows another
-- sweeper holds.
DELETE FROM {table} WHERE (scope, key) IN (
    SELECT scope, key FROM {table} WHERE {expired}
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)
