#!lua
--[[
  deliver_claim: lease the deliveries that are due, so one worker sends each at a time; and drop
  the bucket's dead-letter entries older than the retention (their records have expired; the
  senders call this several times a second, so the stream holds what can still be replayed).

  From-states: pending and due (score <= now) -> pending and leased (score = now + lease). A
  worker that dies while sending lets the lease run out; the delivery is then due again and is
  sent again with the same webhook-id (at-least-once).

  Input:
    KEYS[1] due              (ZSET)   bucket deliveries by due time, ms
    KEYS[2] dead letters     (STREAM) bucket dead-letter stream (entry ids are Redis ms times)
    ARGV[1] lease            ms a claimed delivery stays invisible to other workers
    ARGV[2] count            most deliveries to claim
    ARGV[3] retention        ms a dead record stays readable (deliver_settle's ARGV[7])

  Output:
    {'applied', 'id id ...'} the claimed delivery ids, space-separated
    {'pending'}              nothing is due

  Events:
    XTRIM KEYS[2] MINID <now - retention>
]]
--@include "now_ms"
local now = now_ms()
redis.call('XTRIM', KEYS[2], 'MINID', now - tonumber(ARGV[3]))
local ids = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then
  return {'pending'}
end
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id)
end
return {'applied', table.concat(ids, ' ')}
