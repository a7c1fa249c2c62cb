//! The Lua scripts: each operation is one script, so one round trip, run
//! atomically by Redis. Time is Redis's own (`TIME`), so instances with
//! drifting clocks agree on leases.

/// Claims a record. KEYS[1]: the record. ARGV: scope, key, fingerprint,
/// proposed operation id, new token, lease (ms), retention (ms).
/// Returns `{"won", operation id, locked_until, takeover}` or
/// `{"existing", now, field, value, …}`.
pub(crate) const CLAIM: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local st, fp, lu, ea, tok = unpack(redis.call('HMGET', KEYS[1], 'st', 'fp', 'lu', 'ea', 'tok'))
if st == 'p' and tok == ARGV[5] then
  -- This very claim, sent again (a retried command whose reply was lost):
  -- the same answer, not a conflict with itself.
  local op = redis.call('HGET', KEYS[1], 'op')
  return {'won', op, tostring(lu), op == ARGV[4] and '0' or '1'}
end
local lease_until = now + tonumber(ARGV[6])
local function fresh()
  local expires = now + tonumber(ARGV[7])
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 's', ARGV[1], 'k', ARGV[2], 'fp', ARGV[3], 'op', ARGV[4],
    'tok', ARGV[5], 'st', 'p', 'lu', lease_until, 'ca', now, 'ea', expires)
  redis.call('PEXPIREAT', KEYS[1], math.max(expires, lease_until))
  return {'won', ARGV[4], tostring(lease_until), '0'}
end
if not st then
  return fresh()
end
if tonumber(ea) <= now and (st == 'c' or tonumber(lu) <= now) then
  return fresh()
end
if st == 'p' and tonumber(lu) <= now and fp == ARGV[3] then
  redis.call('HSET', KEYS[1], 'tok', ARGV[5], 'lu', lease_until)
  redis.call('PEXPIREAT', KEYS[1], math.max(tonumber(ea), lease_until))
  return {'won', redis.call('HGET', KEYS[1], 'op'), tostring(lease_until), '1'}
end
local out = {'existing', tostring(now)}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do
  out[#out + 1] = v
end
return out
";

/// Completes a record if it is in progress under the caller's token.
/// KEYS[1]: the record. ARGV: token, status, headers, body. Returns 1 or 0.
pub(crate) const COMPLETE: &str = r"
local st, tok = unpack(redis.call('HMGET', KEYS[1], 'st', 'tok'))
if st ~= 'p' or tok ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'st', 'c', 'sc', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4], 'co', now)
redis.call('HDEL', KEYS[1], 'lu')
return 1
";

/// Releases a record if it is in progress under the caller's token: its
/// lease ends now. KEYS[1]: the record. ARGV: token. Returns 1 or 0.
pub(crate) const RELEASE: &str = r"
local st, tok, lu = unpack(redis.call('HMGET', KEYS[1], 'st', 'tok', 'lu'))
if st ~= 'p' or tok ~= ARGV[1] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(lu) > now then
  redis.call('HSET', KEYS[1], 'lu', now)
end
return 1
";

/// Caches a completed record for replay (tiered mode): written only if the
/// key holds nothing or an in-flight marker, so a newer record is never
/// overwritten by an older one. KEYS[1]: the record. ARGV: field, value, …,
/// then the expiry (unix ms) last.
pub(crate) const CACHE_PUT: &str = r"
local st = redis.call('HGET', KEYS[1], 'st')
if st == 'c' then
  return 0
end
local n = #ARGV
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 1, n - 1))
redis.call('PEXPIREAT', KEYS[1], ARGV[n])
return 1
";

/// An in-flight marker for a claim decided elsewhere (tiered mode): the
/// record's fields replace whatever was there, expiring at the last
/// argument. One script, so that it is atomic on a Redis Cluster too.
pub(crate) const MARK: &str = r"
local n = #ARGV
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 1, n - 1))
redis.call('PEXPIREAT', KEYS[1], ARGV[n])
return 1
";
