-- publish_command(flag): the command that publishes on the question's channel, checked before
-- the first write: 'PUBLISH' on one Redis, 'SPUBLISH' (sharded pub/sub) on a Redis Cluster.
local function publish_command(flag)
  if flag ~= 'PUBLISH' and flag ~= 'SPUBLISH' then
    error('publish must be PUBLISH or SPUBLISH, not ' .. tostring(flag))
  end
  return flag
end
