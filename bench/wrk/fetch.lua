-- fetch: GET /v1/questions/{id} as the asking agent, over a few existing questions in turn.
-- Env: BENCH_AGENT_TOKEN, BENCH_IDS_FILE; BENCH_FETCH_PATH (default /v1/questions/) for the ladder's
-- rungs (bench/ladder.py), which take the same ids under their own paths.
local report = require("report")
setup = report.setup
local requests = {}
local next_index = 0

function init(args)
  local headers = { ["Authorization"] = "Bearer " .. os.getenv("BENCH_AGENT_TOKEN") }
  local path = os.getenv("BENCH_FETCH_PATH") or "/v1/questions/"
  for i, id in ipairs(report.read_ids(os.getenv("BENCH_IDS_FILE"), 0, 1)) do
    requests[i] = wrk.format("GET", path .. id, headers)
  end
end

function request()
  next_index = next_index % #requests + 1
  return requests[next_index]
end

done = report.done
