#!lua flags=allow-oom
--[[
  expire_many: the sweeper's expiry of many questions of one bucket in one call; for each, what
  expire.lua would decide. One call per question cost Redis more in calling the script than in
  the expiry itself (a 100,000-question sweep: docs/benchmarks.md). flags=allow-oom, as
  expire.lua: deadlines are kept while Redis is full.

  From-states: pending and overdue -> expired. pending and not yet due, answered, expired,
  cancelled: nothing changes.

  Input:
    KEYS[1] deadlines        (ZSET)   the bucket's deadline index
    KEYS[2] purge            (ZSET)   the bucket's removal schedule
    KEYS[3] outbox           (STREAM) the bucket's outbox
    KEYS[4] stats            (HASH)   the bucket's counters
    then three keys for each question i = 1..n, all of the same bucket (one slot on a Cluster):
      KEYS[2+3i] question         (HASH)
      KEYS[3+3i] deadline marker  (STRING)
      KEYS[4+3i] channel          (PUBSUB) the question's channel
    ARGV[1] retention        ms
    ARGV[2] outbox maxlen    approximate cap
    ARGV[3] publish          'PUBLISH', or 'SPUBLISH' on a Redis Cluster (sharded pub/sub)
    then two arguments for each question i = 1..n:
      ARGV[2+2i] id          question id
      ARGV[3+2i] call id     unique per question and sweep, reused by client retries

  Output:
    one code per question, in input order:
    'applied'    this call expired it
    'again'      a re-run of this call (a client retry) had expired it: count it once
    'stale'      already terminal
    'pending'    still pending: its deadline has not passed
    'not_found'  no such question; its entry in KEYS[1], if any, is removed (as expire.lua)
    error reply when the keys and arguments do not come in whole triples and pairs, or ARGV
                publish is neither PUBLISH nor SPUBLISH (misuse)

  Events (for each question it expires):
    PUBLISH (or SPUBLISH) <its channel> <cjson fields>
    XADD KEYS[3] type=question.expired id=<id> question=<cjson fields>
    HINCRBY KEYS[4] expired 1
]]
--@include "now_ms"
--@include "expire_overdue"
--@include "publish_command"
local publish = publish_command(ARGV[3])
local n = (#KEYS - 4) / 3
if n ~= math.floor(n) or n ~= (#ARGV - 3) / 2 then
  return redis.error_reply('expire_many: ' .. #KEYS .. ' keys and ' .. #ARGV .. ' arguments are not whole questions')
end
local now = now_ms()
-- One table, its question's keys replaced for each: finish reads them from it.
local k = {deadlines = KEYS[1], purge = KEYS[2], outbox = KEYS[3], stats = KEYS[4]}
local codes = {}
for i = 1, n do
  k.question = KEYS[2 + 3 * i]
  k.marker = KEYS[3 + 3 * i]
  k.channel = KEYS[4 + 3 * i]
  local id, call_id = ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  local q = redis.call('HMGET', k.question, 'state', 'expires_ms', 'tcall')
  if not q[1] then
    redis.call('ZREM', KEYS[1], id)
    codes[i] = 'not_found'
  elseif q[1] ~= 'pending' then
    codes[i] = q[3] == call_id and 'again' or 'stale'
  elseif now >= tonumber(q[2]) then
    expire_overdue(k, id, tonumber(q[2]), now, call_id, ARGV[1], ARGV[2], publish)
    codes[i] = 'applied'
  else
    codes[i] = 'pending'
  end
end
return codes
