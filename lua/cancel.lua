#!lua
--[[
  cancel: withdraw a pending question on behalf of its asker (or an admin).

  From-states: pending -> cancelled. pending and overdue -> expired (the cancel never applies).
  answered | expired | cancelled: nothing changes; the reply carries the stored story.

  Input:
    KEYS[1] question         (HASH)
    KEYS[2] deadline marker  (STRING)
    KEYS[3] deadlines        (ZSET)   bucket deadline index
    KEYS[4] purge            (ZSET)   bucket removal schedule
    KEYS[5] channel          (PUBSUB) the question's channel
    KEYS[6] outbox           (STREAM)
    KEYS[7] stats            (HASH)
    KEYS[8] stale calls      (SET)    call ids already counted as stale taps; expires after 10 min
    ARGV[1] id               question id
    ARGV[2] by               principal id of the canceller, from authentication
    ARGV[3] any asker        '1' when the canceller may cancel any question (an admin)
    ARGV[4] reason           UTF-8 text, may be ''
    ARGV[5] call id          unique per service call, reused by client retries
    ARGV[6] retention        ms
    ARGV[7] outbox maxlen    approximate cap
    ARGV[8] publish          'PUBLISH', or 'SPUBLISH' on a Redis Cluster (sharded pub/sub)

  Output:
    {'applied', fields}      this call cancelled the question
    {'applied', fields, 'again'}  a re-run of the call that did (same call id: a client retry,
                             or the same request sent again with its Idempotency-Key)
    {'stale', fields}        already terminal
    {'stale', fields, 'again'}  a re-run of a stale call (a client retry): counted when it first ran
    {'stale', fields, 'expired_now'}  the deadline has passed: this call expired it
    {'not_found'}            no such question
    {'not_asker', fields}    the canceller is neither the asker nor allowed to cancel any
    error reply              misuse only: ARGV publish is neither PUBLISH nor SPUBLISH

  Events (only when a transition happens):
    PUBLISH (or SPUBLISH) KEYS[5] <cjson fields>
    XADD KEYS[6] type=question.cancelled|question.expired id=<id> question=<cjson fields>
    HINCRBY KEYS[7] cancelled|expired 1; HINCRBY KEYS[7] stale 1 once per stale call id (SADD KEYS[8] remembers it)
]]
--@include "now_ms"
--@include "transition_keys"
--@include "finish"
--@include "refuse_late_tap"
--@include "publish_command"
local publish = publish_command(ARGV[8])
local now = now_ms()
local k = transition_keys()
local q = redis.call('HMGET', KEYS[1], 'state', 'expires_ms', 'tcall', 'asker')
if not q[1] then
  return {'not_found'}
end
if q[4] ~= ARGV[2] and ARGV[3] ~= '1' then
  return {'not_asker', redis.call('HGETALL', KEYS[1])}
end
local refusal = refuse_late_tap(k, ARGV[1], q[1], tonumber(q[2]), q[3], ARGV[5], now, ARGV[6], ARGV[7], publish)
if refusal then
  return refusal
end
return {'applied', finish(k, ARGV[1], 'cancelled', now, now,
  {'cancel_by', ARGV[2], 'cancel_reason', ARGV[4]}, ARGV[5], ARGV[6], ARGV[7], publish)}
