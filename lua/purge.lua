#!lua
--[[
  purge: remove a terminal question whose retention period is over, with its index entries.

  From-states: answered | expired | cancelled, once its purge time (KEYS[2] score) has passed.
  Anything else: nothing changes.

  Input:
    KEYS[1] question         (HASH)
    KEYS[2] purge            (ZSET)   bucket removal schedule, score = max(resolved_ms, now) + retention
    KEYS[3] asker index      (ZSET)   of the question's asker
    KEYS[4] target index     (ZSET)   of the question's target user or room
    ARGV[1] id               question id

  Output:
    1                        removed (question, both index entries, its schedule entry)
    0                        not due yet, or the question is already gone (its leftover schedule
                             entry, if due, is dropped: a hash deleted outside this script)
    error reply              misuse only: the question is still pending

  Events: none. Removal is housekeeping, not a transition.
]]
--@include "now_ms"
local now = now_ms()
local due = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not due or tonumber(due) > now then
  return 0
end
local q = redis.call('HMGET', KEYS[1], 'state', 'created_ms')
if q[1] == 'pending' then
  return redis.error_reply('ERR purge of a pending question: ' .. ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
if not q[2] then
  return 0
end
local member = string.format('%013d:%s', tonumber(q[2]), ARGV[1])
redis.call('ZREM', KEYS[3], member)
redis.call('ZREM', KEYS[4], member)
redis.call('DEL', KEYS[1])
return 1
