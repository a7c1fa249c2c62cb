-- Removes at most ?2 records past their retention (and not held under a
-- live lease) at ?1 now.
DELETE FROM idem_records WHERE rowid IN (
    SELECT rowid FROM idem_records
    WHERE expires_at <= ?1 AND (state = 'completed' OR locked_until <= ?1)
    ORDER BY expires_at
    LIMIT ?2)
