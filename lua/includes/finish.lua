-- finish(id, state, resolved_ms, extra, tcall, retention_ms, outbox_maxlen, publish): the one way a
-- pending question becomes terminal. It writes the terminal fields once, drops the deadline
-- marker and index entry, schedules the removal after the retention period, counts the
-- transition, publishes the terminal fields on the question's channel and appends them to the
-- outbox, all in the calling script. Returns the question's fields (HGETALL).
-- Expects the transition KEYS layout: 1 question, 2 deadline marker, 3 deadlines, 4 purge,
-- 5 channel, 6 outbox, 7 stats. `publish` is 'PUBLISH', or 'SPUBLISH' on a Redis Cluster (sharded
-- pub/sub: the channel is slot-checked like a key, which is why it is in KEYS).
local function finish(id, state, resolved_ms, extra, tcall, retention_ms, outbox_maxlen, publish)
  redis.call('HINCRBY', KEYS[1], 'version', 1)
  redis.call('HSET', KEYS[1], 'state', state, 'resolved_ms', resolved_ms, 'tcall', tcall, unpack(extra))
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZADD', KEYS[4], resolved_ms + tonumber(retention_ms), id)
  redis.call('HINCRBY', KEYS[7], state, 1)
  local fields = redis.call('HGETALL', KEYS[1])
  local payload = cjson.encode(fields)
  redis.call(publish, KEYS[5], payload)
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', outbox_maxlen, '*',
    'type', 'question.' .. state, 'id', id, 'question', payload)
  return fields
end
