-- expire_overdue(k, id, expires_ms, now, tcall, retention_ms, outbox_maxlen, publish): expire a
-- pending question whose deadline has passed (`k`: its keys, as for finish; `now`: Redis TIME of
-- the call). The terminal story of an expiry is dated at the deadline itself, whichever
-- mechanism (inline check, keyspace event, sweeper) noticed it first.
--@include "finish"
local function expire_overdue(k, id, expires_ms, now, tcall, retention_ms, outbox_maxlen, publish)
  return finish(k, id, 'expired', expires_ms, now, {}, tcall, retention_ms, outbox_maxlen, publish)
end
