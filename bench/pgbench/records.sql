-- 10,000 completed records for replay.sql to read, shaped like the shop's.
INSERT INTO idem_records
  (scope, key, fingerprint, operation_id, token, state, locked_until, created_at, expires_at,
   completed_at, status, headers, body, shortest_retention_ms)
SELECT 'pgbench', 'k' || g, sha256(g::text::bytea), gen_random_uuid(), g, 'completed', NULL, now(),
       now() + interval '1 day', now(), 201, '\x'::bytea, convert_to(repeat('x', 220), 'UTF8'), 86400000
FROM generate_series(1, 10000) AS g;
ANALYZE idem_records;
