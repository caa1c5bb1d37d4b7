-- create: POST /v1/questions as an agent; every request creates a new pending question.
-- Env: BENCH_AGENT_TOKEN, BENCH_USER (the target user).
local report = require("report")
wrk.method = "POST"
wrk.path = "/v1/questions"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_AGENT_TOKEN")
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"prompt":"Deploy build 4711 to production?",' ..
  '"options":[{"id":"yes","label":"Yes"},{"id":"no","label":"No"}],' ..
  '"to":{"user":"' .. os.getenv("BENCH_USER") .. '"},"expires_in":3600}'
done = report.done
