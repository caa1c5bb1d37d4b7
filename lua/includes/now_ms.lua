-- now_ms(): Redis TIME in milliseconds, the one clock for every state decision.
-- Read it once, at the top of a script: Redis 7.0 does not freeze TIME while a script runs.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
