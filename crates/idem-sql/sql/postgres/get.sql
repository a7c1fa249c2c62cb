-- The record under a key, unless it is past its retention. $1 scope, $2 key.
SELECT {columns}, {now} AS now FROM {table} WHERE scope = $1 AND key = $2 AND NOT {expired}
