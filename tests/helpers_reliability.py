"""Shared helpers for the reliability suites (races, idempotency, deadlines, re-runs, waiters).

Raw HTTP callers with unbounded connection pools (the test client's session caps at 100
connections, which would serialise a storm), Redis probes that read the truth behind the API,
keyspace snapshots for "changes nothing" checks, and a pub/sub tap that counts publishes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.keys import BUCKETS, Keys
from service.model import Target, canonical_json
from service.redis_client import connect
from service.scripts import Reply, Scripts
from service.settings import Settings
from service.store import NewQuestion, QuestionStore

TERMINAL = ("answered", "expired", "cancelled")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# -- time -----------------------------------------------------------------------------------------


def ms(timestamp: str) -> int:
    """Milliseconds since the epoch of an envelope timestamp (RFC 3339, UTC, milliseconds)."""
    return (datetime.fromisoformat(timestamp) - _EPOCH) // timedelta(milliseconds=1)


def rfc3339(epoch_ms: int) -> str:
    moment = _EPOCH + timedelta(milliseconds=epoch_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"


async def redis_ms(redis: Redis) -> int:
    """Redis TIME in milliseconds: the one clock the service decides by."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def sleep_until_redis_ms(redis: Redis, target_ms: int, *, limit: float = 30.0) -> int:
    """Sleep until Redis TIME reaches target_ms; returns the Redis time seen last."""
    give_up = time.monotonic() + limit
    while True:
        now = await redis_ms(redis)
        if now >= target_ms:
            return now
        assert time.monotonic() < give_up, f"Redis TIME never reached {target_ms}"
        await asyncio.sleep(min(0.05, (target_ms - now) / 1000))


async def loop_time_of(redis: Redis, target_ms: int) -> float:
    """The event-loop time at which Redis TIME will read target_ms (same host, one clock)."""
    loop = asyncio.get_running_loop()
    before = loop.time()
    now = await redis_ms(redis)
    after = loop.time()
    return (before + after) / 2 + (target_ms - now) / 1000


async def sleep_until(moment: float) -> None:
    delay = moment - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within: float, every: float = 0.05, what: str = ""
) -> None:
    """Poll `check` until it holds; fail when it still does not after `within` seconds."""
    give_up = time.monotonic() + within
    while not await check():
        assert time.monotonic() < give_up, f"not within {within} s: {what}"
        await asyncio.sleep(every)


# -- HTTP -----------------------------------------------------------------------------------------


@asynccontextmanager
async def unbounded_session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session with no connection cap, so concurrent requests are really concurrent."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
    try:
        yield session
    finally:
        await session.close()


@dataclass
class Http:
    """JSON calls to one app instance over a shared (unbounded) session."""

    session: aiohttp.ClientSession
    client: TestClient[Any, Any]

    async def call(
        self,
        method: str,
        path: str,
        token: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        sent = {"Authorization": f"Bearer {token}", **(headers or {})}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        url = self.client.make_url(path)
        async with self.session.request(method, url, data=data, headers=sent) as response:
            payload = await response.read()
            return response.status, json.loads(payload) if payload else None

    async def answer(self, token: str, question_id: str, option: str) -> tuple[int, Any]:
        return await self.call("POST", f"/v1/questions/{question_id}/answer", token, {"option": option})

    async def cancel(self, token: str, question_id: str) -> tuple[int, Any]:
        return await self.call("POST", f"/v1/questions/{question_id}/cancel", token, {"reason": "race"})

    async def get(self, token: str, question_id: str) -> tuple[int, Any]:
        return await self.call("GET", f"/v1/questions/{question_id}", token)

    async def wait(self, token: str, question_id: str, timeout: float) -> tuple[int, Any]:
        return await self.call("GET", f"/v1/questions/{question_id}/wait?timeout={timeout}", token)


def ask_body(
    to: Mapping[str, str], *, options: Sequence[str] = ("yes", "no"), **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": "Proceed?",
        "options": [{"id": o, "label": o.title()} for o in options],
        "to": dict(to),
    }
    body.update(extra)
    if "expires_in" not in body and "expires_at" not in body:
        body["expires_in"] = 60
    return body


# -- Redis probes ---------------------------------------------------------------------------------


def open_store(settings: Settings) -> tuple[Redis, Scripts, QuestionStore]:
    """A store of its own over its own client, configured as the service configures one."""
    redis = connect(settings)
    scripts = Scripts(redis)
    return redis, scripts, QuestionStore(redis, scripts, settings)


def new_question(
    *,
    asker: str = "agent",
    to: tuple[str, str] = ("user", "alice"),
    options: Sequence[str] = ("yes", "no"),
    expires_in_ms: int = 60_000,
    expires_at_ms: int = 0,
    digest: str = "digest",
) -> NewQuestion:
    """A create request at the store level (no directory checks; the scripts do not need them)."""
    return NewQuestion(
        asker=asker,
        target=Target(*to),
        prompt="Proceed?",
        options_json=canonical_json([{"id": o, "label": o.title()} for o in options]),
        option_ids=list(options),
        metadata_json="{}",
        expires_in_ms=0 if expires_at_ms else expires_in_ms,
        expires_at_ms=expires_at_ms,
        digest=digest,
    )


async def stats_totals(redis: Redis, prefix: str) -> Counter[str]:
    """The bucket stats hashes ('<prefix>:{b<k>}:stats') summed field by field."""
    keys = Keys(prefix)
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.hgetall(keys.stats(b))
        hashes = await pipe.execute()
    total: Counter[str] = Counter()
    for stats in hashes:
        for name, value in stats.items():
            total[name] += int(value)
    return total


async def outbox_events(redis: Redis, prefix: str) -> list[dict[str, str]]:
    """Every outbox entry of every bucket, as its field dict."""
    keys = Keys(prefix)
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.xrange(keys.outbox(b))
        streams = await pipe.execute()
    return [entry for stream in streams for _, entry in stream]


async def question_hash(redis: Redis, prefix: str, question_id: str) -> dict[str, str]:
    fields: dict[str, str] = await redis.hgetall(Keys(prefix).for_question(question_id).question)
    return fields


async def keys_of(redis: Redis, prefix: str) -> list[str]:
    return sorted([key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)])


async def snapshot(redis: Redis, prefix: str) -> dict[str, Any]:
    """Every key under the prefix with its type, content and whether it has a TTL."""
    shot: dict[str, Any] = {}
    for key in await keys_of(redis, prefix):
        kind = await redis.type(key)
        if kind == "hash":
            value: Any = await redis.hgetall(key)
        elif kind == "zset":
            value = await redis.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            value = await redis.xrange(key)
        elif kind == "string":
            value = await redis.get(key)
        elif kind == "set":
            value = sorted(await redis.smembers(key))
        else:
            value = kind
        shot[key] = (kind, value, await redis.pttl(key) > 0)
    return shot


@dataclass
class ChannelTap:
    """Counts what is published on some channels. Subscribed (and confirmed) before use; `drain`
    publishes a sentinel and reads up to it, so every earlier publish has been seen."""

    redis: Redis
    channels: Sequence[str]
    messages: list[tuple[str, str]] = field(default_factory=list)

    async def __aenter__(self) -> ChannelTap:
        self._pubsub = self.redis.pubsub()
        await self._pubsub.subscribe(*self.channels)
        confirmed = 0
        while confirmed < len(self.channels):
            message = await self._pubsub.get_message(timeout=5.0)
            assert message is not None, "no subscribe confirmation"
            confirmed += message["type"] == "subscribe"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def drain(self) -> list[tuple[str, str]]:
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        await self.redis.publish(self.channels[0], sentinel)
        give_up = time.monotonic() + 10
        while True:
            assert time.monotonic() < give_up, "the sentinel publish never arrived"
            message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is None:
                continue
            if message["data"] == sentinel:
                return self.messages
            self.messages.append((message["channel"], message["data"]))


class Recorder:
    """Remembers every script call a store makes, so a test can run the very same call again
    (same keys, same arguments, same call id), as a redis-py retry would."""

    def __init__(self, scripts: Scripts) -> None:
        self.calls: list[tuple[str, dict[str, str], dict[str, str | int]]] = []
        self.replies: list[Reply] = []
        self._call = scripts.call
        recorder = self

        async def recording(name: str, keys: Mapping[str, str], args: Mapping[str, str | int]) -> Reply:
            recorder.calls.append((name, dict(keys), dict(args)))
            reply = await recorder._call(name, keys, args)
            recorder.replies.append(reply)
            return reply

        scripts.call = recording  # type: ignore[method-assign]

    async def rerun_last(self) -> Reply:
        name, keys, args = self.calls[-1]
        return await self._call(name, keys, args)
