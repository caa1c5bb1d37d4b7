"""Schemathesis fuzzes the running service against its OpenAPI document (service/openapi.yaml).

One `python -m service serve` process on a free port, over its own redis-server, with an admin
token, two agents and three users (two in room `oncall`) and a dozen pending questions. Each
operation gets valid and invalid requests (the examples, coverage and fuzzing phases) as JSON and
as msgpack, asking for JSON or msgpack replies, sent by one of the principals (half the time the
one the route is for), with ids, rooms, users, targets and options that often exist. Every reply
must:

- not be a server error, and have a documented status, content type, headers and body
  (Schemathesis' default checks; msgpack replies are decoded for the body check);
- for a request valid by the document: not be refused by the body schema (a 400, 413 or 415, or
  a 422 that names a field or type: the document must not promise more than msgspec accepts);
- for a request invalid by the document: be refused (the document must not forbid what the
  service accepts);
- for a refused (4xx) request to a route that may write: leave Redis exactly as it was.

The sweeper, keyspace listener, event relay and webhook delivery are off, so only requests change
Redis (and nothing leaves 127.0.0.1).
`GET /v1/events` is not fuzzed: its reply is an endless stream; tests/test_events.py covers it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import pytest
import redis
import requests
import schemathesis
from schemathesis import Case, CheckContext, Response
from schemathesis.core.parameters import ParameterLocation

from bench.procs import ADMIN_TOKEN, ServiceProc
from service.http.openapi import load_document
from tests.api import Api
from tests.redis_server import RedisServer

EXAMPLES_PER_OPERATION = 40
NOT_FUZZED = ["/v1/events"]
WRITES = {"POST", "PUT", "DELETE"}
POSITIVE_STATUSES = ["200", "201", "204", "403", "404", "409", "422"]
NEGATIVE_STATUSES = ["400", "401", "403", "404", "413", "415", "422"]
USERS = ("alice", "bob", "carol")
AGENTS = ("deploybot", "otherbot")
# Whom a route is for, when not an admin route (admin) or a user's (alice): see draw().
INTENDED = {
    "POST /v1/questions": "deploybot",
    "POST /v1/questions/{id}/cancel": "deploybot",
}
# msgspec's wording when the body schema refuses a value (rather than a rule of the service).
SCHEMA_REFUSAL = re.compile(
    r"^(Expected |Object (contains unknown|missing required) field|Invalid enum value)"
)
# The one known gap: JSON Schema counts 600.0 as an integer, msgspec refuses it where an int is
# due (`expires_in`). No schema keyword can say "integer, but not written with a fraction".
INTEGRAL_FLOAT = re.compile(r"^Expected `int( \| null)?`, got `float`")
# The server's own secrets (action-link and VAPID keys): made once, by whichever request needs
# them first, also a refused one (a forged action link is checked against the key).
CREATED_ON_FIRST_USE = b":{dir}:server-keys"

CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {
            "mode": "all",
            "max-examples": EXAMPLES_PER_OPERATION,
            "database": "none",
            # The test sends a real token; generated Authorization values would only be refused.
            "with-security-parameters": False,
        },
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": False},
        },
        "checks": {
            "positive_data_acceptance": {"expected-statuses": POSITIVE_STATUSES},
            "negative_data_rejection": {"expected-statuses": NEGATIVE_STATUSES},
        },
        "request-timeout": 10,
        "operations": [
            {
                # OPTIONS /v1/questions/wait says `Allow: GET,HEAD,POST`, and rightly: GET also
                # matches /v1/questions/{id} (a 404 for the question id "wait").
                "include-path": "/v1/questions/wait",
                "checks": {"allow_header_conformance": {"enabled": False}},
            }
        ],
    }
)


def _huge_int_as_float(value: Any) -> Any:
    """msgpack has no integers beyond 64 bits: a msgpack client sends such a number as a float."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    raise TypeError(f"cannot pack {type(value).__name__}")


@schemathesis.serializer("application/msgpack")
def to_msgpack(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    try:
        return bytes(msgpack.packb(value, use_bin_type=True))
    except OverflowError:
        return bytes(msgpack.packb(value, use_bin_type=True, default=_huge_int_as_float))


@schemathesis.deserializer("application/msgpack")
def from_msgpack(ctx: schemathesis.DeserializationContext, response: Response) -> Any:
    return msgpack.unpackb(response.content, raw=False)


@dataclass
class Live:
    url: str
    tokens: dict[str, str]
    questions: list[str]
    redis: redis.Redis


def seed(url: str) -> tuple[dict[str, str], list[str]]:
    """Principals, room `oncall` (alice, bob) and pending questions, through the API itself."""
    tokens = {"admin": ADMIN_TOKEN}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=url, timeout=10) as http:
        for name, kind in [*((a, "agent") for a in AGENTS), *((u, "user") for u in USERS)]:
            reply = http.post("/v1/admin/principals", json={"id": name, "kind": kind}, headers=admin)
            assert reply.status_code == 201, reply.text
            tokens[name] = reply.json()["token"]
        reply = http.put("/v1/admin/rooms/oncall", json={"members": ["alice", "bob"]}, headers=admin)
        assert reply.status_code == 200, reply.text
        questions = []
        for n in range(12):
            body = {
                "prompt": f"Seeded question {n}?",
                "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
                "to": {"user": "alice"} if n % 2 else {"room": "oncall"},
                "expires_in": 3600,
            }
            agent = {"Authorization": f"Bearer {tokens['deploybot']}"}
            reply = http.post("/v1/questions", json=body, headers=agent)
            assert reply.status_code == 201, reply.text
            questions.append(reply.json()["id"])
    return tokens, questions


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    redis_server = RedisServer().start()
    service = ServiceProc(
        tmp_path_factory.mktemp("schemathesis"),
        redis_server.url,
        run_sweeper="false",
        keyspace_notifications="false",
        run_event_relay="false",
        wait_default_seconds="0.05",
        wait_max_seconds="0.2",
        auth_cache_seconds="0",
        run_delivery="false",
    )
    client = redis.Redis.from_url(redis_server.url)
    try:
        service.start()
        tokens, questions = seed(service.url)
        yield Live(service.url, tokens, questions, client)
    finally:
        client.close()
        service.stop()
        redis_server.stop()
        redis_server.cleanup()


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


# -- the Redis snapshot -------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    digest: str
    volatile: bool  # has a TTL, so it may disappear by itself


READ_ALL = {
    b"string": lambda pipe, key: pipe.get(key),
    b"hash": lambda pipe, key: pipe.hgetall(key),
    b"set": lambda pipe, key: pipe.smembers(key),
    b"zset": lambda pipe, key: pipe.zrange(key, 0, -1, withscores=True),
    b"list": lambda pipe, key: pipe.lrange(key, 0, -1),
    b"stream": lambda pipe, key: pipe.xrange(key),
}


def canonical(value: Any) -> str:
    """Order-free text of a value: DUMP is not, as a large hash serializes in table order."""
    if isinstance(value, dict):
        return repr(sorted(value.items()))
    if isinstance(value, set):
        return repr(sorted(value))
    return repr(value)


def snapshot(client: redis.Redis) -> dict[bytes, Stored]:
    """Every key of the fuzzed service's Redis, with a digest of its content."""
    keys = sorted(client.scan_iter(count=1000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
        pipe.pttl(key)
    described = pipe.execute()
    types, ttls = described[::2], described[1::2]
    for key, kind in zip(keys, types, strict=True):
        read = READ_ALL.get(kind, lambda pipe, key: pipe.type(key))
        read(pipe, key)
    contents = pipe.execute()
    found = {}
    for key, kind, ttl, content in zip(keys, types, ttls, contents, strict=True):
        if kind != b"none" and content:  # else it expired between SCAN and the read
            digest = hashlib.sha256(kind + canonical(content).encode()).hexdigest()
            found[key] = Stored(digest, ttl > 0)
    return found


def changes(before: dict[bytes, Stored], after: dict[bytes, Stored]) -> list[str]:
    before = {k: v for k, v in before.items() if not k.endswith(CREATED_ON_FIRST_USE)}
    after = {k: v for k, v in after.items() if not k.endswith(CREATED_ON_FIRST_USE)}
    found = [f"created {key!r}" for key in sorted(after.keys() - before.keys())]
    found += [f"deleted {key!r}" for key in sorted(before.keys() - after.keys()) if not before[key].volatile]
    found += [f"changed {key!r}" for key in sorted(before.keys() & after.keys()) if before[key] != after[key]]
    return found


def unchanged_since(before: dict[bytes, Stored], client: redis.Redis) -> schemathesis.CheckFunction:
    def refused_request_changes_nothing(ctx: CheckContext, response: Response, case: Case) -> None:
        if 400 <= response.status_code < 500:
            changed = changes(before, snapshot(client))
            assert not changed, f"a refused request ({response.status_code}) changed Redis: {changed}"

    return refused_request_changes_nothing


def body_schema_accepts_valid_bodies(ctx: CheckContext, response: Response, case: Case) -> None:
    """A body valid by the document is not refused by msgspec's schema (a 422 naming a field)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return
    detail = str(response.json().get("detail", ""))
    if INTEGRAL_FLOAT.match(detail):
        return  # 600.0 is an integer to JSON Schema, a float to msgspec: see INTEGRAL_FLOAT
    assert not SCHEMA_REFUSAL.match(detail), f"a body valid by the document was refused: {detail}"


# -- the test -----------------------------------------------------------------------------------

# Loaded at import (the document is static); the live service's URL is given to each call.
# (schemathesis.pytest.from_fixture would load it from a fixture, but 4.32 breaks on pytest 9.)
schema = schemathesis.openapi.from_dict(load_document(), config=CONFIG).exclude(path=NOT_FUZZED)


def aim(case: Case, live: Live, pick: int) -> None:
    """Point some generated requests at things that exist, so they get past the 404s and 422s.
    Only parts generated valid are changed: an invalid part stays as Schemathesis made it."""
    meta = case.meta
    path = case.path_parameters or {}
    if path and not (meta is not None and meta.is_negative_at(ParameterLocation.PATH)):
        if "id" in path and case.path.startswith("/v1/questions/"):
            path["id"] = live.questions[pick % len(live.questions)]
        elif "id" in path and case.path.startswith("/v1/admin/principals/"):
            path["id"] = (*USERS, *AGENTS)[pick % 5]
        if "room" in path:
            path["room"] = "oncall"
        if "user" in path:
            path["user"] = USERS[pick % 3]
    body = case.body
    if isinstance(body, dict) and not (meta is not None and meta.is_negative_at(ParameterLocation.BODY)):
        if isinstance(body.get("to"), dict):
            body["to"] = {"user": "alice"} if pick % 2 else {"room": "oncall"}
        if isinstance(body.get("option"), str):
            body["option"] = ("yes", "no")[pick % 2]
        if isinstance(body.get("ids"), list) and body["ids"]:
            body["ids"] = [live.questions[(pick + i) % len(live.questions)] for i in range(len(body["ids"]))]


@dataclass(frozen=True)
class Draw:
    who: str | None  # None: the principal the route is for
    pick: int | None  # None: leave the generated ids and targets alone
    accept: str


def draw(case: Case) -> Draw:
    """Who sends the case, what it aims at, which reply format it asks for; chosen by the
    case's own content: schema examples cannot be combined with extra Hypothesis strategies,
    and this keeps every case reproducible."""
    content = (case.path_parameters, case.query, case.headers, case.body, case.media_type)
    digest = hashlib.sha256(repr(content).encode()).digest()
    principals = ["admin", *AGENTS, *USERS]
    return Draw(
        who=None if digest[0] % 2 else principals[digest[1] % len(principals)],
        pick=None if digest[2] % 3 == 0 else int.from_bytes(digest[3:5], "big"),
        accept="application/msgpack" if digest[5] % 3 == 0 else "application/json",
    )


@schema.parametrize()
def test_service_keeps_its_openapi_contract(case: Case, live: Live, session: requests.Session) -> None:
    chosen = draw(case)
    route = f"{case.method} {case.path}"
    intended = INTENDED.get(route, "admin" if "/admin/" in case.path else "alice")
    if chosen.pick is not None:
        aim(case, live, chosen.pick)
    checks: list[schemathesis.CheckFunction] = [body_schema_accepts_valid_bodies]
    if case.method in WRITES:
        checks.append(unchanged_since(snapshot(live.redis), live.redis))
    headers = {"Authorization": f"Bearer {live.tokens[chosen.who or intended]}", "Accept": chosen.accept}
    response = case.call(base_url=live.url, session=session, headers=headers)
    case.validate_response(response, additional_checks=checks)


# -- regressions found by this fuzzing ----------------------------------------------------------


async def test_a_wait_whose_timeout_passes_while_it_subscribes_still_returns(api: Api) -> None:
    """The timeout's one cancellation can land inside redis-py's SUBSCRIBE (an asyncio.wait_for
    that swallows it on Python 3.11); the waiter must still leave at its deadline, not park until
    the question ends (here: an hour). The first wait of a process subscribes on a new pub/sub
    connection, which is where a 1 ns timeout lands."""
    agent = await api.principal("deploybot", "agent")
    alice = await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"}, expires_in=3600)
    async with asyncio.timeout(30):  # a guard against the hang, far beyond QS_WAIT_MAX_SECONDS
        reply = await api.wait(alice, question["id"], timeout=1e-9)
    assert reply.status == 200
    assert reply.body["state"] == "pending"


@pytest.mark.parametrize("url", ["http://[::1", "https://[zz]/hook", "http://hooks.example.com:99999/"])
async def test_a_url_that_does_not_parse_is_refused_with_422_not_a_500(api: Api, url: str) -> None:
    agent = await api.principal("deploybot", "agent")
    alice = await api.principal("alice", "user")
    events = ["question.answered"]
    ask = {
        "prompt": "Proceed?",
        "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
        "to": {"user": "alice"},
        "expires_in": 60,
        "webhook_url": url,
    }
    replies = [
        await api.call("POST", "/v1/webhooks", agent, {"url": url, "events": events}),
        await api.call("POST", "/v1/questions", agent, ask),
        await api.call("PUT", "/v1/me/channels/phone", alice, {"kind": "ntfy", "url": url}),
    ]
    for reply in replies:
        assert reply.status == 422, reply.body
        assert reply.body["detail"].startswith("the URL does not parse"), reply.body


async def test_an_action_link_with_non_ascii_characters_is_refused_with_403_not_a_500(api: Api) -> None:
    reply = await api.call("POST", "/v1/actions/%C2%AA.%C3%97%F3%B7%96%99")
    assert reply.status == 403, reply.body
    assert reply.body["type"].endswith("/invalid-action")


def test_the_redis_comparison_sees_writes_but_not_expiry() -> None:
    kept, volatile = Stored("a", volatile=False), Stored("b", volatile=True)
    before = {b"k": kept, b"t": volatile, b"qs:{dir}:server-keys": kept}
    assert changes(before, {b"k": kept, b"t": volatile}) == []  # server keys: made on first use
    assert changes(before, {b"k": kept}) == []  # a key with a TTL may expire meanwhile
    assert changes(before, {b"t": volatile}) == ["deleted b'k'"]
    assert changes(before, {b"k": Stored("c", volatile=False), b"t": volatile}) == ["changed b'k'"]
    assert changes(before, {**before, b"n": kept}) == ["created b'n'"]
