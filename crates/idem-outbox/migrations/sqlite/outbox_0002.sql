-- {table}: the quoted table; {name}: its bare name.
-- The relay claims a row with an ordering key only when no older row of
-- that key is pending. Without this index SQLite answered that by walking
-- every pending row older than the candidate, for each candidate: a cost
-- that grew with the square of the backlog, so a relay that fell behind
-- fell further behind.
CREATE INDEX IF NOT EXISTS "{name}_ordering" ON {table} (ordering_key, seq) WHERE state = 'pending';
