-- A producer cancels a job: the cancel wins unless the job's worker has settled its outcome first
-- (settle.lua). One transition on the job's one record, so the answer to the caller is what then happens
-- (docs/guarantees.md, "Cancel").
-- KEYS: the job's record. ARGV: seconds the cancel is kept at least (the results' lifetime).
-- Returns '' when the cancel won (its state is 'cancelled': no worker will finish the job), else the state
-- the worker settled ('done' or 'failed').
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'failed' then
  return state
end
redis.call('HSET', KEYS[1], 'state', 'cancelled')
-- A job ttsq keeps no record of (a raw send_task) gets one that holds only this.
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return ''
