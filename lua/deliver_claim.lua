#!lua
--[[
  deliver_claim: lease the deliveries that are due, so one worker sends each at a time; and drop
  the bucket's dead-letter entries older than the retention (their records have expired; the
  senders call this several times a second, so the stream holds what can still be replayed).

  From-states: pending and due (score <= now) -> pending and leased (score = now + lease). A
  worker that dies while sending lets the lease run out; the delivery is then due again and is
  sent again with the same webhook-id (at-least-once). A re-run with the same call id (redis-py
  re-sends a call whose reply was lost) returns what that call leased, rather than leaving it
  leased to nobody until the lease runs out; a claim of another call in between overwrites the
  memo, and the re-run then claims afresh (those deliveries wait out their lease, as before).

  A claim memo is written only when something was claimed: an idle sender writes nothing.

  Input:
    KEYS[1] due              (ZSET)   bucket deliveries by due time, ms
    KEYS[2] dead letters     (STREAM) bucket dead-letter stream (entry ids are Redis ms times)
    KEYS[3] last claim       (STRING) bucket memo '<call id> <id id ...>' of the last claim, PX lease
    ARGV[1] lease            ms a claimed delivery stays invisible to other workers
    ARGV[2] count            most deliveries to claim
    ARGV[3] retention        ms a dead record stays readable (deliver_settle's ARGV[7])
    ARGV[4] call id          unique per claim (no spaces)

  Output:
    {'applied', 'id id ...'} the claimed delivery ids, space-separated (a re-run: the same)
    {'pending'}              nothing is due

  Events:
    XTRIM KEYS[2] MINID <now - retention>
]]
--@include "now_ms"
local memo = redis.call('GET', KEYS[3])
if memo then
  local space = string.find(memo, ' ', 1, true)
  if string.sub(memo, 1, space - 1) == ARGV[4] then
    return {'applied', string.sub(memo, space + 1)}
  end
end
local now = now_ms()
redis.call('XTRIM', KEYS[2], 'MINID', now - tonumber(ARGV[3]))
local ids = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then
  return {'pending'}
end
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id)
end
local claimed = table.concat(ids, ' ')
redis.call('SET', KEYS[3], ARGV[4] .. ' ' .. claimed, 'PX', ARGV[1])
return {'applied', claimed}
