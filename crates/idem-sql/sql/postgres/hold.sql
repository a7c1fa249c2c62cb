-- The first statement of the holder's transaction: lock the claimed row for
-- as long as the transaction lasts (NOWAIT: another transaction holding it
-- means the key is busy, never a wait; a lock, not an update, so that
-- claimers' unique checks never wait on it), and end the session if the
-- transaction sits idle longer than the lease. $1 scope, $2 key, $3 token,
-- $4 the idle timeout (ms, as text). No row: another attempt took the claim
-- over in between.
SELECT set_config('idle_in_transaction_session_timeout', $4, true) AS lease
FROM {table}
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
FOR UPDATE NOWAIT
