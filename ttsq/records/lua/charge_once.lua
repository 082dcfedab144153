-- Count a job's audio against an API key's quota once, however often the key reads its result.
-- KEYS: the day's quota counter, the mark that this key was charged for this job.
-- ARGV: audio milliseconds, ttl (s).
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[2]) then
  redis.call('INCRBY', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 0
