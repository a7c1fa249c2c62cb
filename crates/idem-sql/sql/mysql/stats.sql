-- What `idem stats` shows: in progress, of which past their lease,
-- completed, past retention, the oldest record, the database's clock.
SELECT
    CAST(COALESCE(SUM(state = 'in_progress'), 0) AS SIGNED),
    CAST(COALESCE(SUM(state = 'in_progress' AND locked_until <= {now}), 0) AS SIGNED),
    CAST(COALESCE(SUM(state = 'completed'), 0) AS SIGNED),
    CAST(COALESCE(SUM(expires_at <= {now} AND (state = 'completed' OR locked_until <= {now})), 0) AS SIGNED),
    MIN(created_at),
    {now} AS now
FROM {table}
