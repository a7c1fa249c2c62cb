//! The Lua scripts: each write but the first look's claim of a key that
//! holds nothing (one plain `SET … NX`) is one script, so one round trip,
//! run atomically by Redis. Time is Redis's own (`TIME`), so instances with
//! drifting clocks agree on leases. A record is one value (`value.rs` gives
//! its layout), read and written with Redis's bundled `cmsgpack`; a record
//! an earlier idem wrote as a hash is read too, and rewritten as one value
//! by the first script that changes it.

/// Prepended to every script: `now_ms()`, Redis's clock in unix ms; and
/// `load()`, which reads the record at KEYS[1] as a table by position (see
/// `value.rs`), or nil. A hash (the layout before one value) is read into
/// the same table; a claim made by one `SET … NX` (layout 2) is read by its
/// key's expiry into layout 1, which is what a script writes back; a layout
/// this idem does not know is an error, never a guess.
macro_rules! with_load {
    ($script:literal) => {
        concat!(
            r"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function load()
  local raw = redis.pcall('GET', KEYS[1])
  if type(raw) == 'table' and raw.err then
    local h = redis.call('HMGET', KEYS[1], 's', 'k', 'fp', 'op', 'tok', 'st', 'lu', 'ca', 'ea',
      'co', 'sc', 'hd', 'bd')
    if not h[6] then
      return nil
    end
    return {1, h[1], h[2], h[3], h[4], h[5], h[6], tonumber(h[7]) or 0, tonumber(h[8]) or 0,
      tonumber(h[9]) or 0, tonumber(h[10]) or 0, tonumber(h[11]) or 0, h[12] or '', h[13] or ''}
  end
  if not raw then
    return nil
  end
  local r = cmsgpack.unpack(raw)
  if type(r) == 'table' and r[1] == 2 and r[7] == 'p' then
    local expires = redis.call('PEXPIRETIME', KEYS[1])
    local lease, retention = r[8], r[9]
    if expires < 0 or lease < 0 or retention < 0 then
      return redis.error_reply('idem: a claim counted from its key expiry, unreadable')
    end
    local created = expires - math.max(lease, retention, 1)
    -- made by its one SET and never taken over: its retention is the shortest
    r[1], r[8], r[9], r[10], r[15] = 1, created + lease, created, created + retention, retention
  end
  if type(r) ~= 'table' or r[1] ~= 1 then
    return redis.error_reply('idem: a record of a layout this version does not know')
  end
  return r
end
",
            $script
        )
    };
}

/// Claims a record. KEYS[1]: the record. ARGV: scope, key, fingerprint,
/// proposed operation id, new token, lease (ms), retention (ms).
/// Returns `{"won", operation id, locked_until, takeover}` or
/// `{"existing", now, record}` (the record as one value).
pub(crate) const CLAIM: &str = with_load!(
    r"
local now = now_ms()
local r = load()
if r and r.err then
  return r
end
if r and r[7] == 'p' and r[6] == ARGV[5] then
  -- This very claim, sent again (a retried command whose reply was lost):
  -- the same answer, not a conflict with itself. Written again,
  -- unchanged: a WAIT after it (on a connection that may be a new one,
  -- with no write of its own yet; from Redis 7.2 a script that writes
  -- nothing leaves the connection's offset where it was) then counts the
  -- replicas that have the claim, never ones that had nothing to receive.
  redis.call('SET', KEYS[1], cmsgpack.pack(r), 'KEEPTTL')
  return {'won', r[5], tostring(r[8]), r[5] == ARGV[4] and '0' or '1'}
end
local lease_until = now + tonumber(ARGV[6])
local function fresh()
  local expires = now + tonumber(ARGV[7])
  redis.call('SET', KEYS[1], cmsgpack.pack({1, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], 'p',
    lease_until, now, expires, 0, 0, '', '', tonumber(ARGV[7])}), 'PXAT', math.max(expires, lease_until))
  return {'won', ARGV[4], tostring(lease_until), '0'}
end
if not r then
  return fresh()
end
if r[10] <= now and (r[7] == 'c' or r[8] <= now) then
  return fresh()
end
if r[7] == 'p' and r[8] <= now and r[4] == ARGV[3] then
  -- A takeover keeps the record for at least another retention: an answer
  -- it completes late is kept, not lost with a key already due to expire.
  r[6] = ARGV[5]
  r[8] = lease_until
  r[10] = math.max(r[10], now + tonumber(ARGV[7]))
  -- the shortest retention any claim asked for; not known (absent: a value
  -- an idem before field 15 wrote) stays not known
  if r[15] then
    r[15] = math.min(r[15], tonumber(ARGV[7]))
  end
  redis.call('SET', KEYS[1], cmsgpack.pack(r), 'PXAT', math.max(r[10], lease_until))
  return {'won', r[5], tostring(lease_until), '1'}
end
return {'existing', tostring(now), cmsgpack.pack(r)}
"
);

/// Completes a record if it is in progress under the caller's token; a
/// record it already completed with the same response (the completion sent
/// again: its reply was lost, or `WAIT` fell short) stands too.
/// KEYS[1]: the record. ARGV: token, status, headers, body. Returns 1 or 0.
pub(crate) const COMPLETE: &str = with_load!(
    r"
local r = load()
if r and r.err then
  return r
end
if r and r[7] == 'c' and r[6] == ARGV[1] and r[12] == tonumber(ARGV[2])
    and r[13] == ARGV[3] and r[14] == ARGV[4] then
  -- Written again, unchanged: a WAIT after it (on a connection that may
  -- be a new one, with no write of its own yet) then counts the replicas
  -- that have the record, the first write included.
  redis.call('SET', KEYS[1], cmsgpack.pack(r), 'KEEPTTL')
  return 1
end
if not r or r[7] ~= 'p' or r[6] ~= ARGV[1] then
  return 0
end
r[7] = 'c'
r[8] = 0
r[11] = now_ms()
r[12] = tonumber(ARGV[2])
r[13] = ARGV[3]
r[14] = ARGV[4]
redis.call('SET', KEYS[1], cmsgpack.pack(r), 'KEEPTTL')
return 1
"
);

/// Releases a record if it is in progress under the caller's token: its
/// lease ends now. KEYS[1]: the record. ARGV: token. Returns 1 or 0.
pub(crate) const RELEASE: &str = with_load!(
    r"
local r = load()
if r and r.err then
  return r
end
if not r or r[7] ~= 'p' or r[6] ~= ARGV[1] then
  return 0
end
local now = now_ms()
if r[8] > now then
  r[8] = now
  redis.call('SET', KEYS[1], cmsgpack.pack(r), 'KEEPTTL')
end
return 1
"
);

/// Withdraws a claim that did nothing: deletes the record if it is in
/// progress under the caller's token, so the key is free for any request,
/// as if never claimed. KEYS[1]: the record. ARGV: token. Returns 1 or 0.
pub(crate) const WITHDRAW: &str = with_load!(
    r"
local r = load()
if r and r.err then
  return r
end
if not r or r[7] ~= 'p' or r[6] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
"
);

/// Caches a completed record for replay (tiered mode): written only if the
/// key holds nothing or an in-flight marker, so a newer record is never
/// overwritten by an older one. KEYS[1]: the record. ARGV: the record as
/// one value, its expiry (unix ms).
pub(crate) const CACHE_PUT: &str = with_load!(
    r"
local r = load()
if r and (r.err or r[7] == 'c') then
  -- completed already, or a layout this version does not know: left as is
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2])
return 1
"
);
