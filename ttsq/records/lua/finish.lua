-- The job has its final result (or was never sent after all): drop its record, from every set. Its owner
-- (and, for a job that follows another's synthesis, the job it follows) stays behind for as long as its
-- result does, so the jobs API can tell whose job an id is after it finished (docs/security.md, "Tenants").
-- KEYS: record, received zset. ARGV: task id, the unseen zsets' prefix (the record names its queue),
-- seconds to keep the owner (0: drop the record whole, as for a job that was never sent).
-- Returns 1 if there was a record of an unfinished job.
local queue = redis.call('HGET', KEYS[1], 'queue')
-- Per-tenant in-flight cap (defer.lua, release.lua): the job leaves the zset that counts it, if any.
local counted = redis.call('HGET', KEYS[1], 'in_flight')
if counted then
  redis.call('ZREM', counted, ARGV[1])
end
local keep = tonumber(ARGV[3] or '0') or 0
local kept = nil
if keep > 0 then
  kept = redis.call('HMGET', KEYS[1], 'owner', 'follows')
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if queue then
  redis.call('ZREM', ARGV[2] .. queue, ARGV[1])
end
if kept and (kept[1] or kept[2]) then
  if kept[1] then
    redis.call('HSET', KEYS[1], 'owner', kept[1])
  end
  if kept[2] then
    redis.call('HSET', KEYS[1], 'follows', kept[2])
  end
  redis.call('EXPIRE', KEYS[1], keep)
end
return queue and 1 or 0
