-- {table}: the quoted (schema-qualified) table; {name}: its bare name.
-- The sweep deletes the rows sent before a cut-off, oldest first. Without
-- this index it walked the rows in seq order testing each one's sent_at:
-- every row the table holds when none is due yet, once a tick.
CREATE INDEX IF NOT EXISTS "{name}_sent" ON {table} (sent_at) WHERE state = 'sent';
