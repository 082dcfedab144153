-- A worker has its job's outcome (its audio stored, or its failure): it stands unless the job was
-- cancelled first (cancel.lua), in which case the job ends REVOKED instead.
-- KEYS: the job's cancel mark, its settled mark. ARGV: the state (SUCCESS or FAILURE), seconds to keep it.
-- Returns 1 when the worker's outcome stands, 0 when the cancel came first.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', tonumber(ARGV[2]))
return 1
