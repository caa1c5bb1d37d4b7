"""The sweeper scenario: N overdue questions (created with a 1 s deadline through the service's
QuestionStore, no service running, so no other sweeper), then one timed Sweeper.sweep_once, then
proof that each question expired exactly once (stats hash, outbox events, the hashes themselves,
and a second pass that finds nothing)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from bench.seed import create_parallel


def run_sweeper(redis_url: str, n: int) -> dict[str, Any]:
    """Create the overdue questions (several processes), then sweep them in this one."""
    from service.settings import Settings

    prefix = "sw" + uuid.uuid4().hex[:8]
    # Room in the outbox for every created and expired event, so they can all be counted.
    settings = Settings(redis_url=redis_url, key_prefix=prefix, outbox_maxlen=max(1000, 4 * n))
    started = time.perf_counter()
    ids = create_parallel(
        redis_url,
        n,
        prefix=prefix,
        asker="bench-agent",
        user="bench-user",
        expires_in_ms=1000,
        outbox_maxlen=settings.outbox_maxlen,
    )
    create_seconds = time.perf_counter() - started
    time.sleep(1.2)  # every deadline has passed now
    result = asyncio.run(_sweep(settings, ids))
    result["create_seconds"] = create_seconds
    return result


async def _sweep(settings: Any, ids: list[str]) -> dict[str, Any]:
    from service.keys import BUCKETS, Keys
    from service.redis_client import connect
    from service.scripts import Scripts
    from service.store import QuestionStore
    from service.sweeper import Sweeper

    n = len(ids)
    prefix = settings.key_prefix
    redis = connect(settings)
    scripts = Scripts(redis)
    store = QuestionStore(redis, scripts, settings)
    keys = Keys(prefix)
    sweeper = Sweeper(store, 0.5)
    try:
        cpu_redis0 = await _redis_cpu(redis)
        cpu0, t0 = time.process_time(), time.perf_counter()
        totals = await sweeper.sweep_once()
        seconds = time.perf_counter() - t0
        client_cpu = time.process_time() - cpu0
        redis_cpu = await _redis_cpu(redis) - cpu_redis0
        again = await sweeper.sweep_once()

        # Exactly once: counters, events, hashes.
        async with redis.pipeline(transaction=False) as pipe:
            for b in range(BUCKETS):
                pipe.hget(keys.stats(b), "expired")
            stats_expired = sum(int(v or 0) for v in await pipe.execute())
        events: dict[str, int] = {}
        for b in range(BUCKETS):
            last = "-"
            while True:
                chunk = await redis.xrange(keys.outbox(b), min=last, max="+", count=10_000)
                if last != "-":
                    chunk = chunk[1:]
                if not chunk:
                    break
                for _, fields in chunk:
                    if fields.get("type") == "question.expired":
                        events[fields["id"]] = events.get(fields["id"], 0) + 1
                last = chunk[-1][0]
        states: dict[str, int] = {}
        versions_ok = 0
        for start in range(0, len(ids), 10_000):
            async with redis.pipeline(transaction=False) as pipe:
                for q in ids[start : start + 10_000]:
                    pipe.hmget(keys.for_question(q).question, "state", "version")
                for state, version in await pipe.execute():
                    states[str(state)] = states.get(str(state), 0) + 1
                    versions_ok += version == "2"
        deadlines_left = 0
        for b in range(BUCKETS):
            deadlines_left += await redis.zcard(keys.deadlines(b))
    finally:
        aclose = getattr(scripts, "aclose", None)
        if aclose is not None:
            await aclose()
        await redis.aclose()

    id_set = set(ids)
    exactly_once = (
        totals.expired == n
        and again.expired == 0
        and stats_expired == n
        and set(events) == id_set
        and all(count == 1 for count in events.values())
        and states.get("expired", 0) == n
        and versions_ok == n
        and deadlines_left == 0
    )
    return {
        "n": n,
        "seconds": seconds,
        "per_second": n / seconds if seconds > 0 else float("nan"),
        "expired": totals.expired,
        "second_pass_expired": again.expired,
        "stats_expired": stats_expired,
        "expired_events": sum(events.values()),
        "distinct_expired_events": len(events),
        "states": states,
        "version_2": versions_ok,
        "deadlines_left": deadlines_left,
        "exactly_once": exactly_once,
        "sweeper_cpu_seconds": client_cpu,
        "redis_cpu_seconds": redis_cpu,
    }


async def _redis_cpu(redis: Any) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
