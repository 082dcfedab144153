-- Delete a claim or a lease only if it still holds our value: one that expired and was taken by
-- someone else must not be released by us finishing late.
-- KEYS: the claim or lease. ARGV: the value we wrote (a task id, a worker's node name).
-- Returns 1 if it was deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
