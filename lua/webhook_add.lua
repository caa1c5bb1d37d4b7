#!lua
--[[
  webhook_add: register a webhook endpoint, unless its owner already has as many as allowed.
  The count and the write are one step, so parallel registrations cannot pass the cap together.

  From-states: none -> registered (a new endpoint id; the caller makes it unique).

  Input:
    KEYS[1] webhook          (HASH)   the endpoint's record
    KEYS[2] owner endpoints  (SET)    ids of the owner's endpoints
    ARGV[1] id               the new endpoint's id
    ARGV[2] cap              most endpoints one owner may have
    ARGV[3] owner            principal id
    ARGV[4] url              where deliveries go
    ARGV[5] events           comma-separated event types
    ARGV[6] secret           the signing secret (whsec_...)

  Output:
    {'applied', created}     registered; created is Redis TIME, ms; also on a re-run of the call
                             (the id is new per call), which writes nothing
    {'full'}                 the owner has `cap` endpoints already; nothing written

  Events: none.
]]
--@include "now_ms"
local now = now_ms()
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  -- A re-run (redis-py resends after a lost reply): checked before the cap, which the first
  -- run may have filled.
  return {'applied', redis.call('HGET', KEYS[1], 'created_ms')}
end
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  return {'full'}
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'owner', ARGV[3], 'url', ARGV[4], 'events', ARGV[5],
  'secret', ARGV[6], 'created_ms', now)
redis.call('SADD', KEYS[2], ARGV[1])
return {'applied', tostring(now)}
