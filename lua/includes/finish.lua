-- finish(k, id, state, resolved_ms, now, extra, tcall, retention_ms, outbox_maxlen, publish): the one way
-- a pending question becomes terminal. It writes the terminal fields once, drops the deadline
-- marker and index entry, schedules the removal a retention period after `now` (Redis TIME of
-- the call) or `resolved_ms`, whichever is later, counts the
-- transition, publishes the terminal fields on the question's channel and appends them to the
-- outbox, all in the calling script. Returns the question's fields (HGETALL).
-- `k` names the keys (see transition_keys): question, marker, deadlines, purge, channel, outbox,
-- stats; every one of them came in through KEYS. `publish` is 'PUBLISH', or 'SPUBLISH' on a Redis
-- Cluster (sharded pub/sub: the channel is slot-checked like a key, which is why it is in KEYS).
local function finish(k, id, state, resolved_ms, now, extra, tcall, retention_ms, outbox_maxlen, publish)
  redis.call('HINCRBY', k.question, 'version', 1)
  redis.call('HSET', k.question, 'state', state, 'resolved_ms', resolved_ms, 'tcall', tcall, unpack(extra))
  redis.call('DEL', k.marker)
  redis.call('ZREM', k.deadlines, id)
  -- Readable for the retention from when the end is recorded: an expiry noticed late (every
  -- sweeper down for longer than the retention) is dated at its deadline, yet not purged at once.
  redis.call('ZADD', k.purge, math.max(resolved_ms, now) + tonumber(retention_ms), id)
  redis.call('HINCRBY', k.stats, state, 1)
  local fields = redis.call('HGETALL', k.question)
  local payload = cjson.encode(fields)
  redis.call(publish, k.channel, payload)
  redis.call('XADD', k.outbox, 'MAXLEN', '~', outbox_maxlen, '*',
    'type', 'question.' .. state, 'id', id, 'question', payload)
  return fields
end
