-- note_stale(call_id): count a stale tap once per call, even when a client retry re-runs it.
-- The last few stale call ids live in the question's internal 'scalls' field (never part of
-- the envelope); KEYS[1] is the question and KEYS[7] the bucket stats hash.
local function note_stale(call_id)
  local seen = redis.call('HGET', KEYS[1], 'scalls') or '|'
  if string.find(seen, '|' .. call_id .. '|', 1, true) then
    return
  end
  seen = seen .. call_id .. '|'
  while #seen > 512 do
    seen = string.sub(seen, string.find(seen, '|', 2, true))
  end
  redis.call('HSET', KEYS[1], 'scalls', seen)
  redis.call('HINCRBY', KEYS[7], 'stale', 1)
end
