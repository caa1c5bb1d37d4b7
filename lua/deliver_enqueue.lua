#!lua
--[[
  deliver_enqueue: turn one outbox event into one webhook delivery, due now, unless it exists.

  From-states: (none) -> pending. An existing delivery of the same id (the same outbox entry to
  the same endpoint, enqueued again by a consumer that died before acknowledging) is left as is.

  Input:
    KEYS[1] delivery         (HASH)   the delivery record
    KEYS[2] due              (ZSET)   bucket deliveries by due time, ms
    KEYS[3] endpoint index   (ZSET)   the endpoint's deliveries in this bucket, score = created ms
    ARGV[1] id               delivery id (msg_<hex>), the webhook-id of every attempt
    ARGV[2] webhook          endpoint id, or '' for a question's own webhook_url
    ARGV[3] url              target URL
    ARGV[4] type             event type, e.g. question.answered
    ARGV[5] question         question id
    ARGV[6] body             the exact bytes every attempt sends (JSON)
    ARGV[7] index cap        most entries kept in KEYS[3]
    ARGV[8] index ttl        ms KEYS[3] lives after its newest entry (the records it names are
                             removed after the retention too): a question's own webhook or a
                             deleted endpoint leaves no index behind

  Output:
    {'created'}              a new delivery, due now
    {'replayed'}             it existed already; nothing changed

  Events: none. The delivery worker claims it from KEYS[2].
]]
--@include "now_ms"
local now = now_ms()
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'replayed'}
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'webhook', ARGV[2], 'url', ARGV[3], 'type', ARGV[4],
  'question', ARGV[5], 'body', ARGV[6], 'attempts', 0, 'status', 'pending',
  'created_ms', now, 'next_ms', now, 'history', '[]')
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[8])
local over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[7])
if over > 0 then
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, over - 1)
end
return {'created'}
