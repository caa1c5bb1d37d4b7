-- list: GET /v1/questions?role=asker&limit=20 as the asking agent: its newest page, over the 16
-- index buckets (service/store.py, page).
-- Env: BENCH_AGENT_TOKEN.
local report = require("report")
wrk.path = "/v1/questions?role=asker&limit=20"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_AGENT_TOKEN")
done = report.done
