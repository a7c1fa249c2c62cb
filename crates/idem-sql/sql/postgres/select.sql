-- The record under a key, whatever its state, and the database's clock.
-- $1 scope, $2 key.
SELECT {columns}, {now} AS now FROM {table} WHERE scope = $1 AND key = $2
