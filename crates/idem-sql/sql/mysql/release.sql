-- Releases a claim (its lease ends now), fenced by its token. $1 scope,
-- $2 key, $3 token. (sqlx counts matched rows, so a lease that had run out
-- already still counts as released.)
UPDATE {table} SET locked_until = LEAST(locked_until, {now})
WHERE scope = $1 AND `key` = $2 AND token = $3 AND state = 'in_progress'
