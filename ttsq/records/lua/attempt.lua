-- An engine call charged to a job (+1, just before the call) or refunded (-1, once the call returned),
-- in the job's one record: what stays charged counts the calls with the job in them that never returned
-- (ttsq.records.attempts).
-- KEYS: the job's record. ARGV: +1 or -1, seconds a record is kept at least once it counts an attempt (a
-- job ttsq keeps no record of, a raw send_task, gets one that holds only this).
-- Returns the attempts now.
local delta = tonumber(ARGV[1])
if delta < 0 and redis.call('HEXISTS', KEYS[1], 'attempts') == 0 then
  return 0  -- the job finished meanwhile (finish.lua dropped its record): nothing to take back
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', delta)
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return attempts
