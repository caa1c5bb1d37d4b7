-- baseline: GET the bare aiohttp app's one JSON handler (bench/baseline.py).
local report = require("report")
wrk.method = "GET"
wrk.path = "/"
done = report.done
