#!lua
--[[
  answer: record one responder's option, if the question is still pending and not overdue.

  From-states: pending -> answered. pending and overdue -> expired (the answer never applies).
  answered | expired | cancelled: nothing changes; the reply carries the stored story.

  Input:
    KEYS[1] question         (HASH)
    KEYS[2] deadline marker  (STRING)
    KEYS[3] deadlines        (ZSET)   bucket deadline index
    KEYS[4] purge            (ZSET)   bucket removal schedule, score = max(resolved_ms, now) + retention
    KEYS[5] channel          (PUBSUB) the question's channel (passed as a key for Cluster slots)
    KEYS[6] outbox           (STREAM)
    KEYS[7] stats            (HASH)
    KEYS[8] stale calls      (SET)    call ids already counted as stale taps; expires after 10 min
    ARGV[1] id               question id
    ARGV[2] responder        principal id, from authentication
    ARGV[3] option           option id
    ARGV[4] call id          unique per service call, reused by client retries
    ARGV[5] responder rooms  '|room|room|': the rooms the responder belongs to, read just before;
                             '?' when the caller does not know yet whom the question is aimed at
    ARGV[6] retention        ms a terminal question stays readable
    ARGV[7] outbox maxlen    approximate cap
    ARGV[8] publish          'PUBLISH', or 'SPUBLISH' on a Redis Cluster (sharded pub/sub)

  Output:
    {'applied', fields}      this call answered the question
    {'applied', fields, 'again'}  a re-run of the call that did (same call id: a client retry,
                             or the same request sent again with its Idempotency-Key); checked
                             first, so it holds after the responder has left the room too
    {'stale', fields}        already terminal
    {'stale', fields, 'again'}  a re-run of a stale call (a client retry): counted when it first ran
    {'stale', fields, 'expired_now'}  the deadline has passed: this call expired it
    {'not_found'}            no such question
    {'not_eligible', fields} the responder is neither the target user nor in the target room
    {'rooms_needed', room}   ARGV[5] is '?' and the question is aimed at room `room`: nothing
                             changed or counted; the caller reads the membership and calls again
    {'unknown_option'}       ARGV[3] is not one of the question's options (checked after
                             eligibility, before the state, so a bad option is never 'stale')
    error reply              misuse only: ARGV publish is neither PUBLISH nor SPUBLISH

  Events (only when a transition happens):
    PUBLISH (or SPUBLISH) KEYS[5] <cjson fields>
    XADD KEYS[6] type=question.answered|question.expired id=<id> question=<cjson fields>
    HINCRBY KEYS[7] answered|expired 1; HINCRBY KEYS[7] stale 1 once per stale call id (SADD KEYS[8] remembers it)
]]
--@include "now_ms"
--@include "transition_keys"
--@include "finish"
--@include "refuse_late_tap"
--@include "publish_command"
local publish = publish_command(ARGV[8])
local now = now_ms()
local k = transition_keys()
local q = redis.call('HMGET', KEYS[1], 'state', 'to_kind', 'to_id', 'opt_ids', 'expires_ms', 'tcall')
if not q[1] then
  return {'not_found'}
end
if q[6] == ARGV[4] then
  -- The call that answered, run again: the same outcome as its first run, whatever the
  -- responder's rooms are now (only this call's id can be the transition's call id).
  return {'applied', redis.call('HGETALL', KEYS[1]), 'again'}
end
if ARGV[5] == '?' and q[2] == 'room' then
  return {'rooms_needed', q[3]}
end
local eligible = (q[2] == 'user' and q[3] == ARGV[2])
  or (q[2] == 'room' and string.find(ARGV[5], '|' .. q[3] .. '|', 1, true) ~= nil)
if not eligible then
  return {'not_eligible', redis.call('HGETALL', KEYS[1])}
end
if not string.find(q[4], '|' .. ARGV[3] .. '|', 1, true) then
  return {'unknown_option'}
end
local refusal = refuse_late_tap(k, ARGV[1], q[1], tonumber(q[5]), q[6], ARGV[4], now, ARGV[6], ARGV[7], publish)
if refusal then
  return refusal
end
return {'applied', finish(k, ARGV[1], 'answered', now, now,
  {'ans_option', ARGV[3], 'ans_by', ARGV[2], 'ans_ms', now}, ARGV[4], ARGV[6], ARGV[7], publish)}
