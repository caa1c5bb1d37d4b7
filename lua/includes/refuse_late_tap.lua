-- refuse_late_tap(k, id, state, expires_ms, tcall, call_id, now, retention_ms, outbox_maxlen, publish):
-- for answer and cancel, the reply when the tap cannot apply: the question is already
-- terminal (the stored story; 'applied' only for a re-run of the call that made it, and 'again'
-- as the third element of any re-run, so the service counts each call once), or its deadline
-- has passed (it expires now and the tap is stale: {'stale', fields, 'expired_now'}, so the
-- service can count that expiry). nil while it is pending in time.
--@include "settled"
--@include "note_stale"
--@include "expire_overdue"
local function refuse_late_tap(k, id, state, expires_ms, tcall, call_id, now, retention_ms, outbox_maxlen, publish)
  if state ~= 'pending' then
    local reply = settled(tcall, call_id)
    if reply[1] == 'stale' and not note_stale(call_id) then
      reply[3] = 'again'  -- a re-run of a stale call: counted when it first ran
    end
    return reply
  end
  if now >= expires_ms then
    note_stale(call_id)
    return {'stale', expire_overdue(k, id, expires_ms, now, 'inline', retention_ms, outbox_maxlen, publish), 'expired_now'}
  end
  return nil
end
