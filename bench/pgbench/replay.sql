-- A primary-key read of a completed record (bench/run.sh's ceiling for
-- replays and in-flight answers): the least a database-backed repeat costs.
\set k random(1, 10000)
SELECT scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
       completed_at, status, headers, body, shortest_retention_ms
  FROM idem_records WHERE scope = 'pgbench' AND key = 'k' || :k;
