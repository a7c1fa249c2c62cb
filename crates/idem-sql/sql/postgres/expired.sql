(expires_at <= now() AND (state = 'completed' OR locked_until <= now()))
