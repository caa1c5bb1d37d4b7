"""The waiter scenario: N concurrent long-poll waiters, each on its own question, woken by answers
sent at a steady rate. One client process on uvloop (when installed); it reports its own CPU use
and event-loop lag, to show that it is not what limits the figures.

Run by `python -m bench` (which passes a JSON job on stdin and reads the JSON result from stdout):

    {"wait_urls": [...], "answer_urls": [...], "agent_token": "...", "user_token": "...",
     "ids": [...], "warmup": 50, "rate": 500, "park_batch": 250, "redis_url": "...",
     "key_prefix": "qs", "service_pids": [...], "timeout": 300}

With {"baseline_url": ..., "baseline_pid": ..., "n": ...} it parks N requests on the bare
aiohttp app instead and reports only its RSS per parked request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import aiohttp
from redis.asyncio import Redis

from bench.procs import count_service_clients, raise_fd_limit, service_redis_ports, status_kib


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "max": max(ms) if ms else float("nan"),
        "mean": statistics.fmean(ms) if ms else float("nan"),
        "count": len(ms),
    }


def parse_rfc3339(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class LoopLag:
    """How late a 10 ms sleep wakes up: a busy client loop shows up here first."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            self.samples.append(time.perf_counter() - start - 0.01)

    def start(self) -> None:
        self.samples.clear()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return summary_ms(self.samples)


class RedisWatch:
    """Samples the service processes' Redis connections (CLIENT LIST by addr) and RSS."""

    def __init__(self, redis: Redis, pids: Sequence[int], redis_port: int) -> None:
        self.redis = redis
        self.pids = list(pids)
        self.redis_port = redis_port
        self.peak_total = 0
        self.peak_pubsub = 0
        self.peak_rss_kib = [0 for _ in pids]
        self._task: asyncio.Task[None] | None = None

    async def ports(self, pid: int) -> set[int]:
        # Thousands of sockets to look through: in a thread, so this client's loop stays free.
        return await asyncio.to_thread(service_redis_ports, pid, self.redis_port)

    async def sample(self) -> tuple[int, int]:
        clients = await self.redis.client_list()
        total = pubsub = 0
        for i, pid in enumerate(self.pids):
            t, p = count_service_clients(clients, await self.ports(pid))
            total, pubsub = total + t, pubsub + p
            self.peak_rss_kib[i] = max(self.peak_rss_kib[i], status_kib(pid))
        self.peak_total = max(self.peak_total, total)
        self.peak_pubsub = max(self.peak_pubsub, pubsub)
        return total, pubsub

    async def used_within(self, seconds: float) -> int:
        """The service connections that ran a command in the last `seconds` (CLIENT LIST idle):
        the ones this scenario used, as opposed to pool connections left open by earlier load."""
        clients = await self.redis.client_list()
        used = [c for c in clients if int(str(c.get("idle", "0"))) <= seconds]
        return sum([count_service_clients(used, await self.ports(pid))[0] for pid in self.pids])

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(1.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def count_channels(redis: Redis, prefix: str) -> int:
    return len(await redis.pubsub_channels(f"{prefix}:*"))


async def wait_until(check: Any, target: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    value = await check()
    while value < target and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        value = await check()
    return int(value)


async def run_waiters(job: dict[str, Any]) -> dict[str, Any]:
    ids: list[str] = job["ids"]
    warmup = int(job.get("warmup", 50))
    rate = float(job["rate"])
    batch = int(job.get("park_batch", 100))
    timeout = float(job.get("timeout", 300))
    park_limit = float(job.get("park_limit", 60))
    wait_urls: list[str] = job["wait_urls"]
    answer_urls: list[str] = job["answer_urls"]
    pids: list[int] = job["service_pids"]
    redis = Redis.from_url(job["redis_url"], decode_responses=True)
    redis_port = int(job["redis_url"].rsplit(":", 1)[1].split("/")[0])
    prefix = job.get("key_prefix", "qs")
    agent = {"Authorization": f"Bearer {job['agent_token']}"}
    user = {"Authorization": f"Bearer {job['user_token']}"}
    wait_http = aiohttp.ClientSession(
        headers=agent,
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=timeout + 30),
    )
    answer_http = aiohttp.ClientSession(
        headers=user,
        connector=aiohttp.TCPConnector(limit=int(job.get("answer_connections", 32))),
        timeout=aiohttp.ClientTimeout(total=60),
    )
    woke: dict[str, float] = {}
    state: dict[str, str] = {}
    failures: list[str] = []

    finished = [0]

    async def wait_one(i: int, question_id: str, seconds: float) -> None:
        url = f"{wait_urls[i % len(wait_urls)]}/v1/questions/{question_id}/wait?timeout={seconds:g}"
        try:
            async with wait_http.get(url) as reply:
                body = await reply.read()
                now = time.time()
                if reply.status != 200:
                    failures.append(f"wait {reply.status}: {body[:200]!r}")
                    return
                state[question_id] = json.loads(body)["state"]
                woke[question_id] = now
        except (aiohttp.ClientError, TimeoutError) as exc:
            failures.append(f"wait: {exc!r}")
        finally:
            finished[0] += 1

    sent: dict[str, float] = {}
    committed: dict[str, float] = {}
    applied = 0

    async def answer_one(i: int, question_id: str) -> None:
        nonlocal applied
        url = f"{answer_urls[i % len(answer_urls)]}/v1/questions/{question_id}/answer"
        sent[question_id] = time.time()
        try:
            async with answer_http.post(url, json={"option": "yes"}) as reply:
                body = await reply.json()
                if reply.status != 200:
                    failures.append(f"answer {reply.status}: {body}")
                    return
                applied += bool(body["applied"])
                committed[question_id] = parse_rfc3339(body["question"]["answer"]["answered_at"])
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError) as exc:
            failures.append(f"answer: {exc!r}")

    leftover = [0]  # channels still subscribed when the measured phase starts (none, normally)

    async def parked_or_done() -> int:
        """Waiters the service holds (one channel each) plus those that already returned."""
        return await count_channels(redis, prefix) - leftover[0] + finished[0]

    async def park(
        chunk: Sequence[tuple[int, str]], seconds: float, limit: float
    ) -> tuple[list[asyncio.Task[None]], float]:
        """Open the waiters `batch` at a time, each batch once the service holds the previous one
        (a burst of thousands of connects would only overflow the listen backlog)."""
        started = time.perf_counter()
        deadline = time.monotonic() + limit
        tasks: list[asyncio.Task[None]] = []
        finished[0] = 0
        for start in range(0, len(chunk), batch):
            part = chunk[start : start + batch]
            tasks += [asyncio.create_task(wait_one(i, q, seconds)) for i, q in part]
            got = await wait_until(parked_or_done, len(tasks), max(1.0, deadline - time.monotonic()))
            if got < len(tasks) or time.monotonic() > deadline:
                failures.append(f"parking stopped at {got} of {len(tasks)} after {limit:g} s")
                break
            if len(failures) > max(10, len(tasks) // 20):
                failures.append(f"parking stopped after {len(failures)} failed waits")
                break
        return tasks, time.perf_counter() - started

    async def answer_all(chunk: Sequence[tuple[int, str]]) -> tuple[float, float]:
        """Answers at `rate` per second on a fixed schedule (not one after another)."""
        tasks = []
        t0 = time.perf_counter()
        for k, (i, q) in enumerate(chunk):
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(answer_one(i, q)))
        sent_for = time.perf_counter() - t0
        await asyncio.gather(*tasks)
        return sent_for, time.perf_counter() - t0

    numbered = list(enumerate(ids))
    warm, measured = numbered[:warmup], numbered[warmup:]
    watch = RedisWatch(redis, pids, redis_port)
    lag = LoopLag()
    try:
        # Warm-up: the same path end to end, not measured; on a fresh service these are also the
        # first concurrent subscribes. A waiter the service strands returns at its 15 s timeout.
        warm_stranded = 0
        if warm:
            tasks, _ = await park(warm, 15, 15)
            await answer_all(warm)
            _, late = await asyncio.wait(tasks, timeout=20)
            for task in late:
                task.cancel()
            # Woken more than 5 s after its answer: the wake-up was lost and the waiter only
            # returned at its timeout (the service then reads the hash).
            warm_stranded = sum(
                state.get(q) != "answered" or woke.get(q, 1e18) - sent.get(q, 0) > 5 for _, q in warm
            )
        warm_failures = failures[:3]
        failures.clear()
        applied = 0
        await asyncio.sleep(1.0)
        await wait_until(lambda: _negated(count_channels(redis, prefix)), 0, 3)
        leftover[0] = await count_channels(redis, prefix)
        rss_before = [status_kib(pid) for pid in pids]
        idle_total, idle_pubsub = await watch.sample()
        watch.start()
        run_started = time.monotonic()
        tasks, park_seconds = await park(measured, timeout, park_limit)
        # Thousands of parked client requests would make every full GC pass of this client slow
        # (its loop lag would then show in the wake latency): keep them out of the collector.
        gc.collect()
        gc.freeze()
        await asyncio.sleep(0.5)
        rss_parked = [status_kib(pid) for pid in pids]
        parked = await count_channels(redis, prefix) - leftover[0]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        lag.start()
        sent_for, answered_for = await answer_all(measured)
        # Every waiter should have its answer a moment after the last one was sent; one still
        # waiting 30 s later is stranded (reported, not waited for until its timeout).
        _done, pending = await asyncio.wait(tasks, timeout=30)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - wall0
        client_cpu = (time.process_time() - cpu0) / wall
        loop_lag = await lag.stop()
        await watch.stop()
        used = await watch.used_within(time.monotonic() - run_started + 1)
        gc.unfreeze()
    finally:
        await wait_http.close()
        await answer_http.close()
        await redis.aclose()

    qids = [q for _, q in measured]
    n = len(qids)
    good = [q for q in qids if state.get(q) == "answered" and q in woke]
    commit_to_wake = [woke[q] - committed[q] for q in good if q in committed]
    send_to_wake = [woke[q] - sent[q] for q in good if q in sent]
    woken_answered = sum(state.get(q) == "answered" for q in qids)
    growth = [(after - before) for before, after in zip(rss_before, rss_parked, strict=True)]
    return {
        "n": n,
        "rate_target": rate,
        "rate_sent": n / sent_for if sent_for > 0 else float("nan"),
        "answers_applied": applied,
        "woken_answered": woken_answered,
        "not_woken": n - len([q for q in qids if q in woke]),
        "failures": failures[:10],
        "failure_count": len(failures),
        "warmup_stranded": warm_stranded,
        "warmup_n": len(warm),
        "warmup_failures": warm_failures,
        "leftover_channels": leftover[0],
        "park_seconds": park_seconds,
        "parked_channels": parked,
        "commit_to_wake_ms": summary_ms(commit_to_wake),
        "send_to_wake_ms": summary_ms(send_to_wake),
        "rss_before_kib": rss_before,
        "rss_parked_kib": rss_parked,
        "rss_peak_kib": watch.peak_rss_kib,
        "rss_per_waiter_kib": sum(growth) / n if n else float("nan"),
        "redis_clients_idle": {"total": idle_total, "pubsub": idle_pubsub},
        "redis_clients_peak": {"total": watch.peak_total, "pubsub": watch.peak_pubsub},
        "redis_clients_used": used,
        "client_cpu_fraction": client_cpu,
        "client_loop_lag_ms": loop_lag,
        "answer_phase_seconds": answered_for,
        "client_loop": type(asyncio.get_running_loop()).__module__,
    }


async def _negated(count: Any) -> int:
    """wait_until waits for a count to reach a target; negated, 'none left' reaches 0."""
    return -int(await count)


async def park_baseline(job: dict[str, Any]) -> dict[str, Any]:
    """RSS per parked request in the bare aiohttp app: N requests held open on /park."""
    n = int(job["n"])
    url = job["baseline_url"]
    pid = int(job["baseline_pid"])
    batch = int(job.get("park_batch", 100))
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def parked() -> int:
        async with http.get(f"{url}/parked") as reply:
            return int((await reply.json())["parked"])

    async def hold(seconds: float = 120) -> None:
        try:
            async with http.get(f"{url}/park?timeout={seconds:g}") as reply:
                await reply.read()
        except (aiohttp.ClientError, asyncio.CancelledError):
            pass

    # Warm the same path first.
    warm = [asyncio.create_task(hold(1.0)) for _ in range(50)]
    await asyncio.gather(*warm, return_exceptions=True)
    await wait_until(lambda: _negated(parked()), 0, 10)
    await asyncio.sleep(0.5)
    before = status_kib(pid)
    tasks = []
    started = time.perf_counter()
    for start in range(0, n, batch):
        tasks += [asyncio.create_task(hold()) for _ in range(min(batch, n - start))]
        await wait_until(parked, len(tasks), 60)
    park_seconds = time.perf_counter() - started
    await asyncio.sleep(0.5)
    after = status_kib(pid)
    count = await parked()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await http.close()
    return {
        "n": n,
        "parked": count,
        "park_seconds": park_seconds,
        "rss_before_kib": before,
        "rss_parked_kib": after,
        "rss_per_request_kib": (after - before) / n,
    }


def main() -> None:
    raise_fd_limit()
    job = json.loads(sys.stdin.read())
    runner = park_baseline(job) if "baseline_url" in job else run_waiters(job)
    try:
        import uvloop

        result = uvloop.run(runner)
    except ImportError:
        result = asyncio.run(runner)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
