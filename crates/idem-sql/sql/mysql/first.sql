-- The first look: the record under a key, unless it is past its retention,
-- and the database's clock, in one row even when there is no record (its
-- columns then NULL). Knowing the clock lets a new key be claimed by a
-- plain insert (insert.sql) whose lease is known without reading it back.
-- `autocommit`: a session that does not commit each statement by itself
-- is refused (none of the store's one-statement writes would commit). A
-- record past its retention and not held under
-- a live lease comes with `stale` = 1: the claim's transaction replaces it
-- (an insert would fail on it, after waiting for any transaction holding
-- its row). $1 scope, $2 key.
SELECT CONVERT(r.scope USING utf8mb4) AS scope, CONVERT(r.`key` USING utf8mb4) AS `key`,
       r.fingerprint, r.operation_id, r.token, r.state, r.locked_until,
       r.created_at, r.expires_at, r.completed_at, r.status, r.headers, r.body,
       r.shortest_retention_ms, clock.now,
       @@session.autocommit AS autocommit,
       (r.expires_at <= clock.now AND (r.state = 'completed' OR r.locked_until <= clock.now))
           AS stale
FROM (SELECT {now} AS now) AS clock
LEFT JOIN {table} AS r ON r.scope = $1 AND r.`key` = $2
