scope, key, fingerprint, operation_id::text AS operation_id, token, state,
    (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until,
    (extract(epoch FROM created_at) * 1000)::bigint AS created_at,
    (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at,
    (extract(epoch FROM completed_at) * 1000)::bigint AS completed_at,
    status::int8 AS status, headers, body, shortest_retention_ms
