-- A gateway request's API key: known, live, under its rate per minute and its audio quota per day.
-- KEYS: key record. ARGV: rate prefix, quota prefix, minute, day, seconds to the next minute, seconds to
-- midnight. Returns {verdict, retry after (s), key id, the key's default lane}; verdict: ok, unknown,
-- revoked, rate, quota.
local rec = redis.call('HMGET', KEYS[1], 'id', 'revoked_at', 'rate_per_min', 'quota_audio_s', 'lane')
if not rec[1] then return {'unknown', 0, ''} end
if rec[2] then return {'revoked', 0, rec[1]} end
local rate = tonumber(rec[3]) or 0
if rate > 0 then
  local window = ARGV[1] .. rec[1] .. ':' .. ARGV[3]
  local n = redis.call('INCR', window)
  if n == 1 then redis.call('EXPIRE', window, 120) end
  if n > rate then return {'rate', tonumber(ARGV[5]), rec[1]} end
end
local quota = tonumber(rec[4]) or 0
if quota > 0 then
  local used_ms = tonumber(redis.call('GET', ARGV[2] .. rec[1] .. ':' .. ARGV[4]) or '0')
  if used_ms >= quota * 1000 then return {'quota', tonumber(ARGV[6]), rec[1]} end
end
return {'ok', 0, rec[1], rec[5] or ''}
