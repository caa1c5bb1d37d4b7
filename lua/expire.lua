#!lua flags=allow-oom
--[[
  expire: expire the question if its deadline has passed; in every case report where it stands.
  Fetch, list and wait read through this script (the sweeper and the keyspace-event listener
  through expire_many.lua, which decides the same way), so no path can show a pending question
  after its deadline. flags=allow-oom: a full Redis (maxmemory, noeviction) still serves reads
  and still ends questions at their deadline; an expiry adds one outbox entry.

  From-states: pending and overdue -> expired. pending and not yet due, answered, expired,
  cancelled: nothing changes.

  Input:
    KEYS[1] question         (HASH)
    KEYS[2] deadline marker  (STRING)
    KEYS[3] deadlines        (ZSET)   bucket deadline index
    KEYS[4] purge            (ZSET)   bucket removal schedule
    KEYS[5] channel          (PUBSUB) the question's channel
    KEYS[6] outbox           (STREAM)
    KEYS[7] stats            (HASH)
    ARGV[1] id               question id
    ARGV[2] call id          unique per service call, reused by client retries
    ARGV[3] retention        ms
    ARGV[4] outbox maxlen    approximate cap
    ARGV[5] publish          'PUBLISH', or 'SPUBLISH' on a Redis Cluster (sharded pub/sub)

  Output:
    {'applied', fields}      this call expired the question
    {'applied', fields, 'again'}  a re-run of the call that did (a client retry)
    {'stale', fields}        already terminal
    {'pending', fields}      still pending: its deadline has not passed
    {'not_found'}            no such question (never created, or removed after retention); its
                             entry in KEYS[3], if any, is removed, so that a hash deleted outside
                             purge.lua (an operator's DEL, eviction) cannot keep a sweep looping
    error reply              misuse only: ARGV publish is neither PUBLISH nor SPUBLISH

  Events (only when a transition happens):
    PUBLISH (or SPUBLISH) KEYS[5] <cjson fields>
    XADD KEYS[6] type=question.expired id=<id> question=<cjson fields>
    HINCRBY KEYS[7] expired 1
]]
--@include "now_ms"
--@include "transition_keys"
--@include "settled"
--@include "expire_overdue"
--@include "publish_command"
local publish = publish_command(ARGV[5])
local now = now_ms()
local q = redis.call('HMGET', KEYS[1], 'state', 'expires_ms', 'tcall')
if not q[1] then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {'not_found'}
end
if q[1] ~= 'pending' then
  return settled(q[3], ARGV[2])
elseif now >= tonumber(q[2]) then
  return {'applied', expire_overdue(transition_keys(), ARGV[1], tonumber(q[2]), now, ARGV[2], ARGV[3], ARGV[4], publish)}
end
return {'pending', redis.call('HGETALL', KEYS[1])}
