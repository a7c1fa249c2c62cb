-- Removes at most $1 records past their retention (and not held under a
-- live lease), oldest first.
DELETE FROM {table}
WHERE expires_at <= {now} AND (state = 'completed' OR locked_until <= {now})
ORDER BY expires_at
LIMIT $1
