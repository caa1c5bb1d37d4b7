-- settled(tcall, call_id): the reply for a question that is already terminal.
-- {'applied', fields, 'again'} when this very call made the transition earlier (a client retry
-- re-ran the script, or an answer or cancel came again with its Idempotency-Key): 'again' lets
-- the service count it once. {'stale', fields} otherwise. Never an error.
local function settled(tcall, call_id)
  if tcall == call_id then
    return {'applied', redis.call('HGETALL', KEYS[1]), 'again'}
  end
  return {'stale', redis.call('HGETALL', KEYS[1])}
end
