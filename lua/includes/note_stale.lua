-- note_stale(call_id): count a stale tap once per call, even when a client retry re-runs it.
-- KEYS[8] is the question's short-lived set of stale call ids (never part of the question
-- hash, so a terminal question's stored story does not change); KEYS[7] the bucket stats hash.
-- The set holds at most STALE_CALLS_KEPT ids: a client tapping a resolved question in a loop
-- (each call a new id) would otherwise grow it without end. When full it starts over, so a
-- retry is counted twice only if that many other stale calls came between it and its first run.
-- Returns false for a call noted before (a re-run), true otherwise.
local STALE_CALLS_KEPT = 1000
local function note_stale(call_id)
  if redis.call('SISMEMBER', KEYS[8], call_id) == 1 then
    return false
  end
  if redis.call('SCARD', KEYS[8]) >= STALE_CALLS_KEPT then
    redis.call('DEL', KEYS[8])
  end
  redis.call('SADD', KEYS[8], call_id)
  redis.call('HINCRBY', KEYS[7], 'stale', 1)
  redis.call('PEXPIRE', KEYS[8], 600000)
  return true
end
