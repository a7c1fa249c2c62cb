-- The record under a key, whatever its state. $1 scope, $2 key.
SELECT {columns} FROM {table} WHERE scope = $1 AND key = $2
