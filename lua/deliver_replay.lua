#!lua
--[[
  deliver_replay: give a dead-lettered delivery a fresh round of attempts, starting now.

  From-states: dead -> pending (attempts back to 0, history kept). pending | delivered: nothing
  changes. A re-run of the same call (ARGV[2]: redis-py resends a script whose reply was lost)
  reports 'applied' again, not 'stale': the admin's replay did happen.

  Input:
    KEYS[1] delivery         (HASH)
    KEYS[2] due              (ZSET)   bucket deliveries by due time, ms
    KEYS[3] dead letters     (STREAM) bucket dead-letter stream
    ARGV[1] id               delivery id
    ARGV[2] call id          unique per replay request

  Output:
    {'applied', fields}      back in the queue, due now; also for a re-run
    {'stale', fields}        not dead; nothing changed
    {'not_found'}            no such delivery

  Events:
    XDEL KEYS[3] <the delivery's dead-letter entry>
]]
--@include "now_ms"
local now = now_ms()
local fields = redis.call('HMGET', KEYS[1], 'status', 'dead_entry', 'replay_call')
if not fields[1] then
  return {'not_found'}
end
if fields[3] == ARGV[2] then
  return {'applied', redis.call('HGETALL', KEYS[1])}
end
if fields[1] ~= 'dead' then
  return {'stale', redis.call('HGETALL', KEYS[1])}
end
redis.call('XDEL', KEYS[3], fields[2])
redis.call('HSET', KEYS[1], 'status', 'pending', 'attempts', 0, 'next_ms', now, 'dead_entry', '',
  'replay_call', ARGV[2])
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[2], now, ARGV[1])
return {'applied', redis.call('HGETALL', KEYS[1])}
