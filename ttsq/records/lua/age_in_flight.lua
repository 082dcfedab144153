-- Drop the members of tenants' in-flight zsets that no longer count (TTSQ_TENANT_MAX_IN_FLIGHT): a job
-- whose record is gone, or no longer names that zset, finished by a path that did not run finish.lua
-- (its record expired, or finish failed and the record went another way). Every path that ends a job
-- runs finish.lua, so this is a backstop: a tenant's count never stays up for a job that is over.
-- KEYS: the set of tenants with jobs in flight, the mark of the last aging.
-- ARGV: the in-flight zsets' prefix, the records' prefix, seconds between two agings (0: age now).
-- Returns how many members were dropped (0 if another worker aged them less than that long ago).
local every = tonumber(ARGV[3])
if every > 0 and not redis.call('SET', KEYS[2], 1, 'NX', 'EX', every) then
  return 0
end
local dropped = 0
for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local counted = ARGV[1] .. tenant
  for _, id in ipairs(redis.call('ZRANGE', counted, 0, -1)) do
    if redis.call('HGET', ARGV[2] .. id, 'in_flight') ~= counted then
      redis.call('ZREM', counted, id)
      dropped = dropped + 1
    end
  end
  if redis.call('ZCARD', counted) == 0 then
    redis.call('SREM', KEYS[1], tenant)
  end
end
return dropped
