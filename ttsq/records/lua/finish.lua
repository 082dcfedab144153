-- The job has its final result (or was never sent after all): drop its record, from every set.
-- KEYS: record, received zset. ARGV: task id, the unseen zsets' prefix (the record names its queue).
-- Returns 1 if there was a record.
local queue = redis.call('HGET', KEYS[1], 'queue')
-- Per-tenant in-flight cap (defer.lua, release.lua): the job leaves the zset that counts it, if any.
local counted = redis.call('HGET', KEYS[1], 'in_flight')
if counted then
  redis.call('ZREM', counted, ARGV[1])
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if queue then
  redis.call('ZREM', ARGV[2] .. queue, ARGV[1])
end
return queue and 1 or 0
