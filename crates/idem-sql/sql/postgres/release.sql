-- Releases a claim (its lease ends now), fenced by its token. $1 scope,
-- $2 key, $3 token.
UPDATE {table} SET locked_until = least(locked_until, now())
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
