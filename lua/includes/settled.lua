-- settled(tcall, call_id): the reply for a question that is already terminal.
-- 'applied' when this very call made the transition earlier (a client retry re-ran the script),
-- 'stale' otherwise. Either way the caller gets the stored fields, never an error.
local function settled(tcall, call_id)
  local code = 'stale'
  if tcall == call_id then code = 'applied' end
  return {code, redis.call('HGETALL', KEYS[1])}
end
