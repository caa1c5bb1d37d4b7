"""Helpers shared by the contract, authorization-matrix and bad-input tests.

- `send`: one raw HTTP call that keeps the exact response bytes (for byte-for-byte envelope
  comparisons) and turns a dropped connection into a readable failure instead of an exception.
- `snapshot` / `assert_unchanged`: every Redis key under a test's prefix with its value, so a
  test can prove that a refused call wrote nothing.
- `assert_problem`: the RFC 9457 shape every error must have.
- `assert_envelope`: the one envelope shape, with its RFC 3339 millisecond UTC timestamps.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestClient
from fakeredis import FakeAsyncRedis as FakeRedis
from redis.asyncio import Redis

from service.http.appkeys import REDIS, SETTINGS
from service.settings import Settings
from tests.api import Api

T = TypeVar("T")

ENVELOPE_FIELDS = frozenset(
    {"id", "state", "prompt", "options", "to", "asker", "created_at", "expires_at", "resolved_at",
     "answer", "cancellation", "metadata", "version"}
)  # fmt: skip
TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
PROBLEM = "application/problem+json"
DROPPED = 0  # the status `send` reports when the server dropped the connection


# -- raw HTTP -----------------------------------------------------------------------------------


@dataclass
class Raw:
    """One HTTP exchange as it went over the wire."""

    status: int
    headers: dict[str, str]
    content_type: str
    data: bytes
    body: Any = field(default=None)


async def send(
    client: TestClient[Any, Any],
    method: str,
    path: str,
    token: str | None = None,
    *,
    body: Any = None,
    raw: bytes | None = None,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
    msgpack_body: bool = False,
    accept: str | None = None,
) -> Raw:
    """Send one request; `body` is JSON-encoded (or msgpack with `msgpack_body`), `raw` goes as is."""
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = raw
    if body is not None:
        data = msgpack.packb(body, use_bin_type=True) if msgpack_body else json.dumps(body).encode()
        content_type = content_type or ("application/msgpack" if msgpack_body else "application/json")
    if content_type is not None:
        sent["Content-Type"] = content_type
    if accept is not None:
        sent["Accept"] = accept
    try:
        async with client.request(method, path, data=data, headers=sent) as response:
            payload = await response.read()
            decoded: Any = None
            if response.content_type == "application/msgpack":
                decoded = msgpack.unpackb(payload, raw=False)
            elif payload and response.content_type.endswith("json"):
                decoded = json.loads(payload)
            return Raw(response.status, dict(response.headers), response.content_type, payload, decoded)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        return Raw(DROPPED, {}, "", f"the server dropped the connection: {exc!r}".encode())


def redis_of(api: Api) -> Redis:
    redis: Redis = api.client.app[REDIS]
    return redis


def settings_of(api: Api) -> Settings:
    return api.client.app[SETTINGS]


# -- nothing written ----------------------------------------------------------------------------

Snapshot = dict[str, tuple[str, Any, int]]


# Server side, in one round trip: every key under the pattern with its type, a digest of its
# content (read in a canonical order, so an untouched key always digests the same) and its PTTL.
# Streams are digested by their entries only: the relay's consumer-group bookkeeping is not data.
DIGEST_KEYS = """
local function content(k, t)
  if t == 'string' then return redis.call('GET', k) end
  if t == 'hash' then
    local flat, items = redis.call('HGETALL', k), {}
    for i = 1, #flat, 2 do items[#items + 1] = flat[i] .. '\\0' .. flat[i + 1] end
    table.sort(items)
    return table.concat(items, '\\1')
  end
  if t == 'set' then
    local members = redis.call('SMEMBERS', k)
    table.sort(members)
    return table.concat(members, '\\1')
  end
  if t == 'zset' then return table.concat(redis.call('ZRANGE', k, 0, -1, 'WITHSCORES'), '\\1') end
  if t == 'list' then return table.concat(redis.call('LRANGE', k, 0, -1), '\\1') end
  if t == 'stream' then
    -- Entries never change in place: length, first and last id tell every append, trim or XDEL.
    local first = redis.call('XRANGE', k, '-', '+', 'COUNT', 1)
    local last = redis.call('XREVRANGE', k, '+', '-', 'COUNT', 1)
    first = first[1] and first[1][1] or ''
    last = last[1] and last[1][1] or ''
    return redis.call('XLEN', k) .. ':' .. first .. ':' .. last
  end
  return t
end
local out, cursor = {}, '0'
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = page[1]
  for _, k in ipairs(page[2]) do
    local t = redis.call('TYPE', k)['ok']
    out[#out + 1] = {k, t, redis.sha1hex(content(k, t)), redis.call('PTTL', k)}
  end
until cursor == '0'
return out
"""


async def snapshot(redis: Redis, prefix: str) -> Snapshot:
    """Every key under `<prefix>:` with its type, its content (or a digest of it) and its PTTL."""
    if not isinstance(redis, FakeRedis):
        rows = await redis.eval(DIGEST_KEYS, 0, f"{prefix}:*")  # type: ignore[misc]
        return {str(k): (str(t), str(d), int(ttl)) for k, t, d, ttl in rows}
    return await full_snapshot(redis, prefix)


async def full_snapshot(redis: Redis, prefix: str) -> Snapshot:
    """Every key under `<prefix>:` with its type, its full value and its PTTL."""
    keys = sorted([key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)])
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.type(key)
        types = [str(t) for t in await pipe.execute()]
    async with redis.pipeline(transaction=False) as pipe:
        for key, kind in zip(keys, types, strict=True):
            if kind == "string":
                pipe.get(key)
            elif kind == "hash":
                pipe.hgetall(key)
            elif kind == "set":
                pipe.smembers(key)
            elif kind == "zset":
                pipe.zrange(key, 0, -1, withscores=True)
            elif kind == "list":
                pipe.lrange(key, 0, -1)
            elif kind == "stream":
                pipe.xrange(key)
            else:
                pipe.exists(key)
            pipe.pttl(key)
        results = await pipe.execute()
    values = results[0::2]
    ttls = results[1::2]
    found: Snapshot = {}
    for key, kind, value, ttl in zip(keys, types, values, ttls, strict=True):
        if isinstance(value, set):
            value = sorted(value)
        found[key] = (kind, value, int(ttl))
    return found


async def settled_snapshot(redis: Redis, prefix: str, quiet: float = 0.05, limit: float = 5.0) -> Snapshot:
    """A snapshot once background work has settled: every consumer group of every stream under
    the prefix (the event relay reading the outboxes) has read and acknowledged every entry, so
    nothing it does later can be mistaken for a write of the call under test. On fakeredis, which
    lacks the group bookkeeping, two snapshots `quiet` seconds apart must agree instead."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit
    if not isinstance(redis, FakeRedis):
        # Polled: the relay is another component's task, with no event to await from here.
        while not await consumers_caught_up(redis, prefix) and loop.time() < give_up:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        return await snapshot(redis, prefix)
    last = await snapshot(redis, prefix)
    while True:
        await asyncio.sleep(quiet)
        current = await snapshot(redis, prefix)
        same = current.keys() == last.keys() and all(current[k][:2] == last[k][:2] for k in current)
        if same or loop.time() > give_up:
            return current
        last = current


async def consumers_caught_up(redis: Redis, prefix: str) -> bool:
    streams = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000, _type="STREAM")]
    if not streams:
        return True
    async with redis.pipeline(transaction=False) as pipe:
        for key in streams:
            pipe.xinfo_stream(key)
            pipe.xinfo_groups(key)
        replies = await pipe.execute()
    for info, groups in zip(replies[0::2], replies[1::2], strict=True):
        for group in groups:
            if group["pending"] or group["last-delivered-id"] != info["last-generated-id"]:
                return False
    return True


def assert_unchanged(before: Snapshot, after: Snapshot, what: str = "the call") -> None:
    """No key appeared, vanished or changed value, and no TTL was extended or removed."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    assert not added, f"{what} wrote new keys: {added}"
    assert not removed, f"{what} deleted keys: {removed}"
    changed = [k for k in before if before[k][:2] != after[k][:2]]
    assert not changed, f"{what} changed keys: " + "; ".join(
        f"{k}: {before[k][1]!r} -> {after[k][1]!r}" for k in changed
    )
    for key, (_, _, ttl_before) in before.items():
        ttl_after = after[key][2]
        if ttl_before < 0:
            assert ttl_after == ttl_before, f"{what} gave {key} a TTL"
        else:
            assert 0 <= ttl_after <= ttl_before, f"{what} extended or removed the TTL of {key}"


class Unchanged:
    """`async with Unchanged(api): <bad call>` asserts the call wrote nothing under the prefix."""

    def __init__(self, api: Api, what: str = "the refused call") -> None:
        self.redis = redis_of(api)
        self.prefix = settings_of(api).key_prefix
        self.what = what
        self.before: Snapshot = {}

    async def __aenter__(self) -> Unchanged:
        self.before = await settled_snapshot(self.redis, self.prefix)
        return self

    async def __aexit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is None:
            assert_unchanged(self.before, await snapshot(self.redis, self.prefix), self.what)


# -- problems and envelopes ---------------------------------------------------------------------


def assert_problem(reply: Raw, status: int | tuple[int, ...]) -> dict[str, Any]:
    """An RFC 9457 problem with this status (or one of these): the right media type, the four
    members, no stack trace."""
    text = reply.data.decode(errors="replace")
    allowed = status if isinstance(status, tuple) else (status,)
    assert reply.status != DROPPED, text
    assert reply.status != 500, f"a 500 where {status} was due: {text}"
    assert reply.status in allowed, f"expected {status}, got {reply.status}: {text}"
    assert reply.content_type == PROBLEM, f"{reply.content_type} is not {PROBLEM}: {text}"
    problem = json.loads(reply.data)
    assert isinstance(problem, dict)
    for member in ("type", "title", "status", "detail"):
        assert member in problem, f"problem lacks {member!r}: {problem}"
    assert problem["status"] == reply.status
    for member in ("type", "title", "detail"):
        assert isinstance(problem[member], str), problem
        assert problem[member], f"problem {member!r} is empty: {problem}"
    for marker in ("Traceback", 'File "', '.py", line'):
        assert marker not in text, f"the problem leaks a stack trace: {text}"
    return problem


def parse_ts(value: str) -> datetime:
    assert TIMESTAMP.match(value), f"{value!r} is not RFC 3339 UTC with milliseconds"
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def assert_envelope(envelope: dict[str, Any]) -> None:
    """The envelope shape: every field present, typed, timestamps RFC 3339 UTC with ms."""
    missing = ENVELOPE_FIELDS - set(envelope)
    assert not missing, f"envelope lacks {sorted(missing)}: {envelope}"
    assert envelope["state"] in ("pending", "answered", "expired", "cancelled")
    assert isinstance(envelope["id"], str)
    assert envelope["id"]
    assert isinstance(envelope["prompt"], str)
    assert isinstance(envelope["options"], list)
    assert all(set(o) >= {"id", "label"} for o in envelope["options"])
    assert len(envelope["to"]) == 1
    assert set(envelope["to"]) <= {"user", "room"}
    assert isinstance(envelope["asker"], str)
    assert isinstance(envelope["version"], int)
    assert isinstance(envelope["metadata"], dict | None)
    created, expires = parse_ts(envelope["created_at"]), parse_ts(envelope["expires_at"])
    assert expires > created
    terminal = envelope["state"] != "pending"
    if terminal:
        assert parse_ts(envelope["resolved_at"]) >= created
    else:
        assert envelope["resolved_at"] is None
    if envelope["state"] == "answered":
        answer = envelope["answer"]
        assert set(answer) >= {"option", "responder", "answered_at"}
        assert answer["option"] in [o["id"] for o in envelope["options"]]
        assert parse_ts(answer["answered_at"]) < expires
    else:
        assert envelope["answer"] is None
    if envelope["state"] == "cancelled":
        assert set(envelope["cancellation"]) >= {"by", "reason"}
    else:
        assert envelope["cancellation"] is None


def now_utc() -> datetime:
    return datetime.now(UTC)


async def within(seconds: float, awaitable: Awaitable[T], what: str) -> T:
    """A liveness guard (not a latency claim): fail clearly instead of hanging for a long poll."""
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        pytest.fail(f"{what} did not return within {seconds} s")


def question_body(target: dict[str, str], /, **changes: Any) -> dict[str, Any]:
    """A valid create body aimed at `target`; `changes` replace or add fields (even `to`), and a
    value of ... removes the field."""
    body: dict[str, Any] = {
        "prompt": "Deploy build 42 to production?",
        "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
        "to": target,
        "expires_in": 600,
    }
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


# -- a small cast of principals -----------------------------------------------------------------


@dataclass
class Cast:
    """Principals of one test: two agents, a direct target, two members of room `ops`, an outsider."""

    api: Api
    agent: str  # deploybot, the asker
    other_agent: str  # otherbot
    alice: str  # a user, the usual direct target, in no room
    bob: str  # a member of room ops
    carol: str  # a member of room ops
    dave: str  # a user in no room, an outsider

    @property
    def admin(self) -> str:
        return self.api.admin


async def make_cast(api: Api) -> Cast:
    tokens = {}
    for name, kind in [("deploybot", "agent"), ("otherbot", "agent"), ("alice", "user"),
                       ("bob", "user"), ("carol", "user"), ("dave", "user")]:  # fmt: skip
        tokens[name] = await api.principal(name, kind)
    await api.room("ops", ["bob", "carol"])
    return Cast(
        api,
        agent=tokens["deploybot"],
        other_agent=tokens["otherbot"],
        alice=tokens["alice"],
        bob=tokens["bob"],
        carol=tokens["carol"],
        dave=tokens["dave"],
    )
