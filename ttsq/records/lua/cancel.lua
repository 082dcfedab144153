-- A producer cancels a job: the cancel wins unless the job's worker has settled its outcome first
-- (settle.lua). One transition, so the answer to the caller is what then happens (docs/guarantees.md,
-- "Cancel").
-- KEYS: the job's cancel mark, its settled mark. ARGV: seconds to keep the mark (the results' lifetime).
-- Returns '' when the cancel won (the mark is set: no worker will finish the job), else the state the
-- worker settled (SUCCESS or FAILURE).
local settled = redis.call('GET', KEYS[2])
if settled then
  return settled
end
redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[1]))
return ''
