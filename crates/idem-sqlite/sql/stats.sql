-- What `idem stats` shows: in progress, of which past their lease,
-- completed, past retention, the oldest record. ?1 now (ms).
SELECT
    count(*) FILTER (WHERE state = 'in_progress'),
    count(*) FILTER (WHERE state = 'in_progress' AND locked_until <= ?1),
    count(*) FILTER (WHERE state = 'completed'),
    count(*) FILTER (WHERE expires_at <= ?1 AND (state = 'completed' OR locked_until <= ?1)),
    min(created_at)
FROM idem_records
