#!lua
--[[
  deliver_settle: record one attempt of a delivery and decide what follows.

  From-states: pending -> delivered (a 2xx), pending -> pending (failed, retried after the delay
  ARGV[6] gives for this attempt), pending -> dead (failed and no retry left). The delay is
  picked here by the recorded attempt count, not by the sender: two senders that both sent an
  attempt (a lease ran out) step through the schedule once each, never past its end.
  delivered | dead: nothing changes (another worker settled it after a lease ran out). A re-run
  of the same call (ARGV[9]: redis-py resends a script whose reply was lost) reports what the
  first run did and changes nothing: counted twice, an attempt would cut the delivery's retries
  short.

  Input:
    KEYS[1] delivery         (HASH)
    KEYS[2] due              (ZSET)   bucket deliveries by due time, ms
    KEYS[3] dead letters     (STREAM) bucket dead-letter stream
    ARGV[1] id               delivery id
    ARGV[2] ok               '1' for a 2xx response, '0' otherwise
    ARGV[3] status           HTTP status, 0 when no response came
    ARGV[4] error            why it failed, '' on success
    ARGV[5] duration         ms the attempt took
    ARGV[6] retry delays     ms before the retry after attempt 1, 2, ..., space-separated; an
                             attempt beyond the list is the last; '' when retrying is pointless
    ARGV[7] retention        ms a delivered or dead record stays readable
    ARGV[8] history cap      most attempts kept in the record
    ARGV[9] call id          unique per attempt settled

  Output:
    {'applied', fields}      the record after this attempt (HGETALL); also for a re-run
    {'stale', fields}        already delivered or dead; nothing changed
    {'not_found'}            no such delivery (expired after its retention)

  Events:
    XADD KEYS[3] id=<id> webhook=<endpoint> type=<type> question=<id> when the delivery goes dead
]]
--@include "now_ms"
local now = now_ms()
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'not_found'}
end
if redis.call('HGET', KEYS[1], 'settle_call') == ARGV[9] then
  return {'applied', redis.call('HGETALL', KEYS[1])}
end
if status ~= 'pending' then
  return {'stale', redis.call('HGETALL', KEYS[1])}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local delays = {}
for delay in string.gmatch(ARGV[6], '%d+') do
  table.insert(delays, tonumber(delay))
end
local retry_in = delays[attempts]
local history = cjson.decode(redis.call('HGET', KEYS[1], 'history'))
table.insert(history, {at_ms = now, status = tonumber(ARGV[3]), error = ARGV[4],
  duration_ms = tonumber(ARGV[5])})
while #history > tonumber(ARGV[8]) do
  table.remove(history, 1)
end
redis.call('HSET', KEYS[1], 'history', cjson.encode(history), 'last_ms', now, 'settle_call', ARGV[9])
if ARGV[2] == '1' then
  redis.call('HSET', KEYS[1], 'status', 'delivered', 'next_ms', '')
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
elseif not retry_in then
  local fields = redis.call('HMGET', KEYS[1], 'webhook', 'type', 'question')
  local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'webhook', fields[1],
    'type', fields[2], 'question', fields[3])
  redis.call('HSET', KEYS[1], 'status', 'dead', 'next_ms', '', 'dead_entry', entry)
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
else
  local next_ms = now + retry_in
  redis.call('HSET', KEYS[1], 'next_ms', next_ms)
  redis.call('ZADD', KEYS[2], next_ms, ARGV[1])
end
return {'applied', redis.call('HGETALL', KEYS[1])}
