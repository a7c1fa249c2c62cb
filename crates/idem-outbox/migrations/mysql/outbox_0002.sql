-- {table}: the quoted (database-qualified) table; {name}: its bare name.
-- The sweep deletes the rows sent before a cut-off, oldest first. Without
-- this index it walked every sent row kept (by state, seq), reading each
-- one's sent_at, when none was due yet, once a tick. One statement: a
-- re-run after a cut between it and its version row finds the index there
-- (MySQL 8 has no CREATE INDEX IF NOT EXISTS).
CREATE INDEX `{name}_sent` ON {table} (state, sent_at)
