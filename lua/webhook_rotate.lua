#!lua
--[[
  webhook_rotate: give an endpoint a new signing secret, if it still exists and is the caller's.
  The check and the write are one step: a rotate that raced a delete must not leave a hash with
  only a secret in it.

  From-states: registered -> registered (new secret). Missing, or another owner's: nothing changes.

  Input:
    KEYS[1] webhook          (HASH)   the endpoint's record
    ARGV[1] owner            the calling principal's id
    ARGV[2] secret           the new signing secret (whsec_...)

  Output:
    {'applied', fields}      the record with its new secret (HGETALL)
    {'not_found'}            no such endpoint, or not this owner's; nothing written

  Events: none.
]]
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return {'not_found'}
end
redis.call('HSET', KEYS[1], 'secret', ARGV[2])
return {'applied', redis.call('HGETALL', KEYS[1])}
