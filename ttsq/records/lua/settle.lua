-- A worker has its job's outcome (its audio stored, or its failure): it stands unless the job was
-- cancelled first (cancel.lua), in which case the job ends REVOKED instead.
-- KEYS: the job's record. ARGV: its state ('done' or 'failed'), seconds the outcome is kept at least.
-- Returns 1 when the worker's outcome stands, 0 when the cancel came first.
if redis.call('HGET', KEYS[1], 'state') == 'cancelled' then
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
-- A job ttsq keeps no record of (a raw send_task) gets one that holds only this.
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 1
