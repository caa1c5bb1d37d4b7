-- report.lua: the `done` hook every bench script shares. It prints one line, BENCH_JSON {...},
-- that bench/loadgen.py parses (requests/s and latency percentiles in microseconds).
local M = {}

function M.done(summary, latency, requests)
  local seconds = summary.duration / 1e6
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"seconds":%.6f,"rps":%.2f,"bytes":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\n',
    summary.requests, seconds, summary.requests / seconds, summary.bytes,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end

-- The ids in a file, one a line; with several wrk threads each takes every n-th one.
function M.read_ids(path, index, count)
  local ids = {}
  local n = 0
  for line in io.lines(path) do
    if #line > 0 then
      if n % count == index then
        ids[#ids + 1] = line
      end
      n = n + 1
    end
  end
  if #ids == 0 then
    error("no ids in " .. path)
  end
  return ids
end

-- Number the threads in setup() so each knows its share of the ids.
local threads = 0
function M.setup(thread)
  thread:set("thread_index", threads)
  threads = threads + 1
end

return M
