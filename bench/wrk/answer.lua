-- answer: POST /v1/questions/{id}/answer as the target user; each request answers the next
-- pre-created pending question from BENCH_IDS_FILE (a stale tap only after the file runs out:
-- the harness makes it long enough and reports the applied fraction from Redis' counters).
-- Env: BENCH_USER_TOKEN, BENCH_IDS_FILE, BENCH_WRK_THREADS.
local report = require("report")
setup = report.setup
local requests = {}
local next_index = 0

function init(args)
  local headers = {
    ["Authorization"] = "Bearer " .. os.getenv("BENCH_USER_TOKEN"),
    ["Content-Type"] = "application/json",
  }
  local ids = report.read_ids(os.getenv("BENCH_IDS_FILE"), thread_index or 0,
    tonumber(os.getenv("BENCH_WRK_THREADS") or "1"))
  for i, id in ipairs(ids) do
    requests[i] = wrk.format("POST", "/v1/questions/" .. id .. "/answer", headers, '{"option":"yes"}')
  end
end

function request()
  next_index = next_index % #requests + 1
  return requests[next_index]
end

done = report.done
