-- A producer is about to send an accepted job: if its queue's list is full (the window), or its tenant
-- already has jobs waiting, the job waits in its tenant's place instead, out of the unseen set (no
-- sweeper sends it: it is not lost, it is deferred), until a worker releases it (release.lua).
-- KEYS: record, unseen zset, the tenant's deferred list, the queue's tenant ring, the queue's tenant set.
-- ARGV: task id, tenant, window (jobs of the queue accepted and not yet received by a worker).
-- Returns 1 if the job was deferred (do not send it), 0 to send it now.
if redis.call('HEXISTS', KEYS[1], 'task') == 0 then
  return 0
end
if redis.call('LLEN', KEYS[3]) == 0 and redis.call('ZCARD', KEYS[2]) <= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'deferred', ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[1])
if redis.call('SADD', KEYS[5], ARGV[2]) == 1 then
  redis.call('RPUSH', KEYS[4], ARGV[2])
end
return 1
