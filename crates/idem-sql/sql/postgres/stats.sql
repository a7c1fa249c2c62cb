-- What `idem stats` shows: in progress, of which past their lease,
-- completed, past retention, the oldest record, the database's clock.
SELECT
    count(*) FILTER (WHERE state = 'in_progress'),
    count(*) FILTER (WHERE state = 'in_progress' AND locked_until <= now()),
    count(*) FILTER (WHERE state = 'completed'),
    count(*) FILTER (WHERE {expired}),
    (extract(epoch FROM min(created_at)) * 1000)::bigint,
    {now} AS now
FROM {table}
