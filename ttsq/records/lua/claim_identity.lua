-- A worker announces its model on its deployment, unless a live worker there serves one of its modes
-- with another model (one queue, one model). Atomic: of two workers that start together with different
-- models, the first one wins and the other is told whom it lost to.
-- KEYS: the fleet (mode -> identity), the deployment's workers (node -> identity).
-- ARGV: the node, its identity (JSON with "modes" and "announced_at"), the oldest "announced_at" of a
--   live worker, the oldest worth keeping (a worker entry older than this is removed), the identity's
--   fields two models must agree on (JSON list).
-- Returns {} once announced, or {node, identity} of a live worker it conflicts with (nothing written).
local mine = cjson.decode(ARGV[2])
local live_since, keep_since = tonumber(ARGV[3]), tonumber(ARGV[4])
local fields = cjson.decode(ARGV[5])

local function serves_a_mode_of_mine(other)
  for _, theirs in ipairs(other.modes or {}) do
    for _, ours in ipairs(mine.modes) do
      if theirs == ours then
        return true
      end
    end
  end
  return false
end

local function another_model(other)
  for _, field in ipairs(fields) do
    if other[field] ~= mine[field] then
      return true
    end
  end
  return false
end

local entries = redis.call('HGETALL', KEYS[2])
for i = 1, #entries, 2 do
  local node, raw = entries[i], entries[i + 1]
  if node ~= ARGV[1] then -- a node name is one process: its own older entry is a previous life
    local ok, other = pcall(cjson.decode, raw)
    if not ok or type(other) ~= 'table' then
      redis.call('HDEL', KEYS[2], node) -- not what ttsq writes: never a reason to refuse
    else
      local at = tonumber(other.announced_at) or 0
      if at < keep_since then
        redis.call('HDEL', KEYS[2], node)
      elseif at >= live_since and serves_a_mode_of_mine(other) and another_model(other) then
        return {node, raw}
      end
    end
  end
end

redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
for _, mode in ipairs(mine.modes) do
  redis.call('HSET', KEYS[1], mode, ARGV[2])
end
return {}
