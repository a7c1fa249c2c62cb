-- Whether the record is completed under this token with this response: a
-- completion sent again after it landed (its answer was lost on the way
-- back). $1 scope, $2 key, $3 token, $4 status, $5 headers, $6 body.
SELECT 1 AS landed FROM {table}
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'completed'
  AND status = $4 AND headers = $5 AND body = $6
