-- The shortest retention any claim of a record asked for, in ms: what
-- the records an operation's attempts made (its steps') are kept for at
-- least, where a takeover asking for more keeps the record longer. NULL:
-- not known (a row written before this column). One statement: its
-- duplicate-column error on a re-run (MySQL commits DDL by itself, before
-- the row that records it) counts as applied.
ALTER TABLE {table} ADD COLUMN shortest_retention_ms BIGINT
