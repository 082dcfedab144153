-- Store a state that is not final (Celery's result meta: a document's PROGRESS, a job's REQUEUED) and
-- publish it, unless the task already holds a final state: a late chunk, or a job given back after its
-- worker died, must not take a finished task back.
-- KEYS: the document's result key. ARGV: the encoded meta, its time to live (s; 0: none).
-- Returns 1 if stored.
local current = redis.call('get', KEYS[1])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and (meta.status == 'SUCCESS' or meta.status == 'FAILURE'
      or meta.status == 'REVOKED') then
    return 0
  end
end
if tonumber(ARGV[2]) > 0 then
  redis.call('setex', KEYS[1], ARGV[2], ARGV[1])
else
  redis.call('set', KEYS[1], ARGV[1])
end
redis.call('publish', KEYS[1], ARGV[1])
return 1
