-- batch_wait: POST /v1/questions/wait {"ids": [every seeded id], "timeout": 0, "mode": "any"}, a
-- fleet's or a user's "what of these has an outcome now?": it reads every question and returns.
-- Env: BENCH_AGENT_TOKEN (the caller), BENCH_IDS_FILE.
local report = require("report")
local request_bytes

function init(args)
  local quoted = {}
  for i, id in ipairs(report.read_ids(os.getenv("BENCH_IDS_FILE"), 0, 1)) do
    quoted[i] = '"' .. id .. '"'
  end
  local body = '{"ids":[' .. table.concat(quoted, ",") .. '],"timeout":0,"mode":"any"}'
  local headers = {
    ["Authorization"] = "Bearer " .. os.getenv("BENCH_AGENT_TOKEN"),
    ["Content-Type"] = "application/json",
  }
  request_bytes = wrk.format("POST", "/v1/questions/wait", headers, body)
end

function request()
  return request_bytes
end

done = report.done
