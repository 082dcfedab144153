-- Forget a holder whose messages went back: unless it beats again, or holds a tag (one it popped after
-- it woke from a pause, or one a failed look left): deleting that would leave the message to the
-- visibility timeout if the holder died later.
-- KEYS: the holder set, the holder's heartbeat, its held set. ARGV: the holder's name, the dead mark.
-- Returns 1 if it was forgotten.
local beat = redis.call('GET', KEYS[2])
if (beat and beat ~= ARGV[2]) or redis.call('SCARD', KEYS[3]) > 0 then
  return 0
end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
