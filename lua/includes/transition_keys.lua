-- transition_keys(): one question's transition keys, from the KEYS layout that answer, cancel and
-- expire share: 1 question, 2 deadline marker, 3 deadlines, 4 purge, 5 channel, 6 outbox, 7 stats.
-- expire_many builds the same table from its own layout, one question after another.
local function transition_keys()
  return {question = KEYS[1], marker = KEYS[2], deadlines = KEYS[3], purge = KEYS[4],
    channel = KEYS[5], outbox = KEYS[6], stats = KEYS[7]}
end
