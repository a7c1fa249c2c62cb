-- Completes a claim, fenced by its token: no row changes if another attempt
-- took it over. $1 scope, $2 key, $3 token, $4 status, $5 headers, $6 body.
UPDATE {table}
SET state = 'completed', locked_until = NULL, completed_at = now(),
    status = $4, headers = $5, body = $6
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
