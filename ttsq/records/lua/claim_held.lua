-- Recovery claims one delivery tag of a holder it found dead, before it gives the message back: the tag
-- moves from the holder's held set to the claiming process's own. Of two looks that give back one holder
-- at once, only the one that moved a tag restores it (kombu keeps a message's tag when it goes back, so a
-- second restore would find the entry of the worker that popped it again, and push it twice); and a look
-- that decided before a pause claims nothing of a holder that beats again.
-- KEYS: the holder's heartbeat, its held set, the claiming process's held set.
-- ARGV: the tag, the launcher's dead mark.
-- Returns 1 if this process claimed the tag.
local beat = redis.call('GET', KEYS[1])
if beat and beat ~= ARGV[2] then
  return 0
end
return redis.call('SMOVE', KEYS[2], KEYS[3], ARGV[1])
