-- The record under a key, whatever its state. ?1 scope, ?2 key.
SELECT scope, key, fingerprint, operation_id, token, state, locked_until,
       created_at, expires_at, completed_at, status, headers, body
FROM idem_records WHERE scope = ?1 AND key = ?2
