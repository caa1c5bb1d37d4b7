-- note_stale(call_id): count a stale tap once per call, even when a client retry re-runs it.
-- KEYS[8] is the question's short-lived set of stale call ids (never part of the question
-- hash, so a terminal question's stored story does not change); KEYS[7] the bucket stats hash.
local function note_stale(call_id)
  if redis.call('SADD', KEYS[8], call_id) == 1 then
    redis.call('HINCRBY', KEYS[7], 'stale', 1)
  end
  redis.call('PEXPIRE', KEYS[8], 600000)
end
