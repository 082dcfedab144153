-- Extend a lease only while we still hold it.
-- KEYS: the lease. ARGV: the holder's value, the new time to live (milliseconds).
-- Returns 1 if it was extended.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
