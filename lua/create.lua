#!lua
--[[
  create: persist a new pending question with its deadline, index entries and outbox event.

  From-states: none (the question must not exist). A re-run with the same call id reports the
  question it created the first time.

  Input:
    KEYS[1] question         (HASH)   the question's fields
    KEYS[2] deadline marker  (STRING) expires at the deadline; its keyspace event is a hint
    KEYS[3] deadlines        (ZSET)   bucket deadline index, score = expires_ms
    KEYS[4] outbox           (STREAM) bucket outbox
    KEYS[5] stats            (HASH)   bucket counters
    KEYS[6] asker index      (ZSET)   lex members "<created_ms:13>:<id>" of the asker's questions
    KEYS[7] target index     (ZSET)   same, for the target user or room
    KEYS[8] idempotency key  (HASH)   optional: {id, digest} of (asker, Idempotency-Key)
    ARGV[1]  id                 question id
    ARGV[2]  call id            unique per service call, reused by client retries
    ARGV[3]  asker              principal id of the agent
    ARGV[4]  to kind            'user' | 'room'
    ARGV[5]  to id              user id or room id
    ARGV[6]  prompt             UTF-8 text
    ARGV[7]  options            JSON array of {id, label}, encoded by the service
    ARGV[8]  option ids         '|a|b|' for membership checks
    ARGV[9]  metadata           JSON object encoded by the service, or '' for none
    ARGV[10] expires in         ms, or 0 when ARGV[11] is used
    ARGV[11] expires at         ms since the epoch, or 0 when ARGV[10] is used
    ARGV[12] longest lifetime   ms; an absolute deadline further away than this is refused
    ARGV[13] request digest     digest of the request body (idempotency)
    ARGV[14] idempotency ttl    ms
    ARGV[15] index ttl          ms; refreshed on each index write
    ARGV[16] outbox maxlen      approximate cap (XADD MAXLEN ~)
    ARGV[17] webhook url        the question's own webhook URL, or '' for none
    ARGV[18] webhook secret     whsec_ secret that signs deliveries to ARGV[17], or ''
    ARGV[19] asker cap          most members KEYS[6] may hold (the asker's share of its quota in
                                this bucket: pending questions and ended ones not yet purged)

  Output:
    {'created', fields}             the new question (HGETALL), also on a re-run of this call
    {'replayed', id}                the idempotency key names question id with the same digest
    {'idempotency_conflict'}        the idempotency key was used with another request digest
    {'bad_deadline', now_ms}        ARGV[11] is not later than now, or more than ARGV[12] ms away
    {'full', cap}                   KEYS[6] already holds ARGV[19] questions: nothing written
    error reply                     misuse only: an id collision

  Events:
    XADD KEYS[4] type=question.created id=<id> question=<cjson fields>
    HINCRBY KEYS[5] created 1
]]
--@include "now_ms"
local now = now_ms()

local prior_call = redis.call('HGET', KEYS[1], 'ccall')
if prior_call then
  if prior_call == ARGV[2] then
    return {'created', redis.call('HGETALL', KEYS[1])}
  end
  return redis.error_reply('ERR question id collision: ' .. ARGV[1])
end

if #KEYS == 8 then
  local prior = redis.call('HMGET', KEYS[8], 'id', 'digest')
  if prior[1] then
    if prior[2] ~= ARGV[13] then
      return {'idempotency_conflict'}
    end
    return {'replayed', prior[1]}
  end
end

if redis.call('ZCARD', KEYS[6]) >= tonumber(ARGV[19]) then
  return {'full', ARGV[19]}
end

local expires
if ARGV[10] ~= '0' then
  expires = now + tonumber(ARGV[10])
else
  expires = tonumber(ARGV[11])
  if expires <= now or expires - now > tonumber(ARGV[12]) then
    return {'bad_deadline', tostring(now)}
  end
end

redis.call('HSET', KEYS[1],
  'id', ARGV[1], 'state', 'pending', 'asker', ARGV[3], 'to_kind', ARGV[4], 'to_id', ARGV[5],
  'prompt', ARGV[6], 'options', ARGV[7], 'opt_ids', ARGV[8], 'meta', ARGV[9],
  'created_ms', now, 'expires_ms', expires, 'version', 1, 'ccall', ARGV[2])
if ARGV[17] ~= '' then
  redis.call('HSET', KEYS[1], 'hook_url', ARGV[17], 'hook_secret', ARGV[18])
end
redis.call('SET', KEYS[2], ARGV[1], 'PXAT', expires)
redis.call('ZADD', KEYS[3], expires, ARGV[1])
local member = string.format('%013d:%s', now, ARGV[1])
for i = 6, 7 do
  redis.call('ZADD', KEYS[i], 0, member)
  redis.call('PEXPIRE', KEYS[i], ARGV[15])
end
if #KEYS == 8 then
  redis.call('HSET', KEYS[8], 'id', ARGV[1], 'digest', ARGV[13])
  redis.call('PEXPIRE', KEYS[8], ARGV[14])
end
redis.call('HINCRBY', KEYS[5], 'created', 1)
local fields = redis.call('HGETALL', KEYS[1])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[16], '*',
  'type', 'question.created', 'id', ARGV[1], 'question', cjson.encode(fields))
return {'created', fields}
