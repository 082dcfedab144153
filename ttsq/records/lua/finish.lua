-- The job has its final result (or was never sent after all): drop its record, from every set. What
-- answers for it afterwards stays behind: its owner (and, for a job that follows another's synthesis,
-- the job it follows) for as long as its result lasts, so the jobs API can tell whose job an id is
-- (docs/security.md, "Tenants"); and its state, so a cancel that read the job unfinished just before
-- still gets the outcome its worker settled (cancel.lua), and a copy of a cancelled job that arrives
-- later is still dropped (received.lua).
-- KEYS: record, received zset. ARGV: task id, the unseen zsets' prefix (the record names its queue),
-- seconds to keep the owner and a cancel (0: drop the record whole, as for a job that was never sent),
-- seconds to keep a settled outcome that nothing else keeps (as long as the job can be in flight).
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
  kept = redis.call('HMGET', KEYS[1], 'owner', 'follows', 'state')
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if queue then
  redis.call('ZREM', ARGV[2] .. queue, ARGV[1])
end
if kept then
  local owner, follows, state = kept[1], kept[2], kept[3]
  if state and state ~= 'cancelled' and state ~= 'done' and state ~= 'failed' then
    state = nil  -- not an outcome: nothing answers from it
  end
  for field, value in pairs({owner = owner, follows = follows, state = state}) do
    if value then
      redis.call('HSET', KEYS[1], field, value)
    end
  end
  if owner or follows or state == 'cancelled' then
    redis.call('EXPIRE', KEYS[1], keep)
  elseif state then
    redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4] or keep) or keep)
  end
end
return queue and 1 or 0
