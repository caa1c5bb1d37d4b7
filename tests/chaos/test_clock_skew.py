"""The service's own clock is skewed by an hour (faketime): deadlines still follow Redis TIME.

The service runs as a subprocess with libfaketime preloaded (`FAKETIME=+1h` / `-1h`, as
`faketime -f +1h` would run it; it shifts every clock the process reads, the monotonic one
too), against a real redis-server whose clock is not shifted. Redis TIME is the only clock that
decides, so nothing may expire early or late.
"""

from __future__ import annotations

import asyncio
import glob
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from bench.procs import ADMIN_TOKEN, ServiceProc
from service.keys import Keys
from tests.helpers_reliability import eventually, ms, redis_ms, sleep_until_redis_ms
from tests.redis_server import RedisServer, require_tool

# The library the `faketime` command preloads (Debian: /usr/lib/<multiarch>/faketime/).
LIBFAKETIME = sorted(
    glob.glob("/usr/lib/*/faketime/libfaketime.so.1") + glob.glob("/usr/lib/faketime/libfaketime.so.1")
)
MISSING = "faketime is not installed (Debian: apt-get install faketime)"
DEADLINE_S = 2


def faketime_prefix(offset: str) -> list[str]:
    """A command prefix that runs the service with its clocks shifted by `offset`. The preload
    through `env` (which execs) rather than the `faketime` command (which forks and waits): the
    pid the test stops is then the service itself, not a wrapper that would orphan it.
    A skip with the reason when libfaketime is missing, or a failure under CI=true."""
    library = require_tool(LIBFAKETIME[0] if LIBFAKETIME else None, MISSING)
    return ["env", f"LD_PRELOAD={library}", f"FAKETIME={offset}"]


class Http:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def call(self, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any, str]:
        headers = {"Authorization": f"Bearer {token}"}
        async with self.session.request(method, self.base + path, json=body, headers=headers) as reply:
            return reply.status, await reply.json(), reply.headers.get("Date", "")

    async def principal(self, principal_id: str, kind: str) -> str:
        status, body, _ = await self.call(
            "POST", "/v1/admin/principals", ADMIN_TOKEN, {"id": principal_id, "kind": kind}
        )
        assert status == 201, body
        token: str = body["token"]
        return token

    async def ask(self, token: str) -> dict[str, Any]:
        body = {
            "prompt": "Proceed?",
            "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
            "to": {"user": "alice"},
            "expires_in": DEADLINE_S,
        }
        status, question, _ = await self.call("POST", "/v1/questions", token, body)
        assert status == 201, question
        result: dict[str, Any] = question
        return result


@asynccontextmanager
async def skewed_service(tmp_path: Path, offset: str) -> AsyncIterator[tuple[Http, Redis, Keys]]:
    """Redis (true clock) and the service under faketime, with the sweeper as the only enforcer
    of deadlines besides reads (keyspace notifications off)."""
    prefix_command = faketime_prefix(offset)
    server = RedisServer().start()
    prefix = "skew"
    proc = ServiceProc(
        tmp_path,
        server.url,
        command_prefix=prefix_command,
        key_prefix=prefix,
        keyspace_notifications="false",
        sweep_interval_seconds="0.2",
    )
    redis = Redis.from_url(server.url, decode_responses=True)
    try:
        await asyncio.to_thread(proc.start)
        async with aiohttp.ClientSession() as session:
            yield Http(session, proc.url), redis, Keys(prefix)
    finally:
        await redis.aclose()
        await asyncio.to_thread(proc.stop)
        server.cleanup()


@pytest.fixture(params=["+1h", "-1h"], ids=["service-1h-ahead", "service-1h-behind"])
async def skewed(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Http, Redis, Keys]]:
    offset: str = request.param
    async with skewed_service(tmp_path, offset) as (http, redis, keys):
        # The skew is real: the service's own Date header is an hour off the true clock.
        _, _, date = await http.call("GET", "/healthz", "")
        skew = parsedate_to_datetime(date).timestamp() - time.time()
        expected = 3600 if offset.startswith("+") else -3600
        assert abs(skew - expected) < 120, f"faketime did not shift the service clock: {skew:.0f} s"
        yield http, redis, keys


async def state_and_time(redis: Redis, key: str) -> tuple[str, int]:
    """A question's stored state and Redis TIME, read atomically."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hget(key, "state")
        pipe.time()
        state, (seconds, micros) = await pipe.execute()
    return state, int(seconds) * 1000 + int(micros) // 1000


async def test_no_question_expires_early_or_late_when_the_service_clock_is_an_hour_off(
    skewed: tuple[Http, Redis, Keys],
) -> None:
    """Invariants: with the service's clock an hour ahead or behind, a question created with a
    2 s deadline gets created_at = Redis TIME and expires_at = created_at + 2 s; it reads
    pending (via fetch, and in Redis, where the sweeper runs every 0.2 s) at every moment
    before its deadline by Redis TIME, and expired after it: via fetch, via the sweeper alone
    (a question nobody reads), and to a waiter, each with resolved_at = expires_at."""
    http, redis, keys = skewed
    agent = await http.principal("agent", "agent")
    await http.principal("alice", "user")
    before = await redis_ms(redis)
    fetched, swept, waited = [await http.ask(agent) for _ in range(3)]
    after = await redis_ms(redis)
    for question in (fetched, swept, waited):
        assert before <= ms(question["created_at"]) <= after, "created_at is not Redis TIME"
        assert ms(question["expires_at"]) - ms(question["created_at"]) == DEADLINE_S * 1000
    waiting = asyncio.create_task(http.call("GET", f"/v1/questions/{waited['id']}/wait?timeout=20", agent))

    deadline = max(ms(q["expires_at"]) for q in (fetched, swept, waited))
    first = min(ms(q["expires_at"]) for q in (fetched, swept, waited))
    swept_key = keys.for_question(swept["id"]).question
    checks = 0
    while True:
        _, envelope, _ = await http.call("GET", f"/v1/questions/{fetched['id']}", agent)
        stored, now = await state_and_time(redis, swept_key)
        if now >= first:
            break
        assert envelope["state"] == "pending", f"expired early: {envelope}"
        assert stored == "pending", f"the sweeper expired it early, at Redis TIME {now}"
        assert not waiting.done(), f"a waiter returned early: {waiting.result()}"
        checks += 1
        await asyncio.sleep(0.1)
    assert checks >= 5, "too few checks before the deadline to show anything"

    await sleep_until_redis_ms(redis, deadline)
    status, envelope, _ = await http.call("GET", f"/v1/questions/{fetched['id']}", agent)
    assert (status, envelope["state"]) == (200, "expired")
    assert envelope["resolved_at"] == envelope["expires_at"]

    async def swept_by_the_sweeper() -> bool:
        return bool(await redis.hget(swept_key, "state") == "expired")

    await eventually(swept_by_the_sweeper, within=10, what="the sweeper expires an unread question")
    resolved_ms, expires_ms = await redis.hmget(swept_key, ["resolved_ms", "expires_ms"])
    assert resolved_ms == expires_ms

    status, woken, _ = await asyncio.wait_for(waiting, timeout=25)
    assert status == 200, woken
    assert woken["state"] == "expired", woken
    assert woken["resolved_at"] == woken["expires_at"]
