#!lua
--[[
  channel_put: add or replace one of a user's Ping channels, unless adding would pass the cap.
  The count and the write are one step, so parallel registrations cannot pass the cap together.

  From-states: none -> registered (a new name, while under the cap); registered -> registered
  (the same name: replaced, whatever the count).

  Input:
    KEYS[1] channels         (HASH)   the user's channels, name -> channel JSON
    ARGV[1] name             the channel's name
    ARGV[2] channel          the channel as JSON (kind, url, token, secret, keys)
    ARGV[3] cap              most channels one user may have

  Output:
    {'applied'}              stored
    {'full'}                 a new name while the user has `cap` channels; nothing written

  Events: none.
]]
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return {'full'}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {'applied'}
