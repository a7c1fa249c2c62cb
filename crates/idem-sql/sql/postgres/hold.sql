-- The first statement of the holder's transaction: lock the claimed row for
-- as long as the transaction lasts (NOWAIT: another transaction holding it
-- means the key is busy, never a wait; a lock, not an update, so that
-- claimers' unique checks never wait on it), end the session if the
-- transaction sits idle longer than the lease, and cancel any one of its
-- statements that runs (or waits on a lock) longer than the lease, unless
-- the session's own statement_timeout is shorter: either way the row, and
-- with it the key, is held no longer than a lease at a time. $1 scope,
-- $2 key, $3 token, $4 the lease (ms, as text). No row: another attempt
-- took the claim over in between.
SELECT set_config('idle_in_transaction_session_timeout', $4, true) AS lease,
       set_config('statement_timeout',
                  CASE WHEN current_setting('statement_timeout')::interval > interval '0'
                        AND current_setting('statement_timeout')::interval
                            <= ($4 || ' ms')::interval
                       THEN current_setting('statement_timeout')
                       ELSE $4 END,
                  true) AS statement_bound
FROM {table}
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'
FOR UPDATE NOWAIT
