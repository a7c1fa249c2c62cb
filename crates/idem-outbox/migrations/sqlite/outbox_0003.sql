-- {table}: the quoted table; {name}: its bare name.
-- The sweep deletes the rows sent before a cut-off, oldest first. Without
-- this index it walked every sent row kept, testing each one's sent_at,
-- when none was due yet, once a tick.
CREATE INDEX IF NOT EXISTS "{name}_sent" ON {table} (state, sent_at);
