"""Authorization under attack: generated calls by every principal kind on every question route,
with tokens tampered by one byte, revoked tokens, and a responder identity smuggled in the body,
the query, the headers or msgpack extension types.

tests/test_auth_matrix.py pins the exact statuses of the plain matrix; this is its superset under
attack, and checks one thing after every call: no unauthorized state change, ever (the question's
hash in Redis is byte-for-byte what it was, unless the caller was entitled to change it, and then
the story names the caller, never a smuggled identity).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from service.bodies import IDENTITY_FIELDS
from service.keys import BUCKETS, Keys
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_contract import question_body, send
from tests.redis_server import RedisServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

# principal kind -> principal id (None: the bootstrap admin token)
WHO = {
    "admin": None,
    "asker": "asker-bot",
    "other_agent": "other-bot",
    "target": "tess",
    "member": "mona",
    "outsider": "olaf",
}
SMUGGLED = ["tess", "mona", "asker-bot", "admin"]
ROUTES = {
    "fetch": ("GET", "/v1/questions/{id}"),
    "wait": ("GET", "/v1/questions/{id}/wait?timeout=0"),
    "answer": ("POST", "/v1/questions/{id}/answer"),
    "cancel": ("POST", "/v1/questions/{id}/cancel"),
}
IDENTITY_HEADERS = ["X-Responder", "X-User", "X-User-Id", "X-Forwarded-User", "X-Principal", "From"]


@dataclass
class World:
    client: TestClient[Any, Any]
    redis: Redis
    keys: Keys
    tokens: dict[str, str]
    revoked: dict[str, str]

    async def ask(self, to: dict[str, str]) -> str:
        reply = await send(self.client, "POST", "/v1/questions", self.tokens["asker"], body=question_body(to))
        assert reply.status == 201, reply.data
        question_id: str = reply.body["id"]
        return question_id

    async def stored(self, question_id: str) -> dict[str, str]:
        fields: dict[str, str] = await self.redis.hgetall(self.keys.for_question(question_id).question)
        return fields


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(redis_server: RedisServer) -> AsyncIterator[World]:
    settings = settings_for(redis_server.url)
    client = await start_client(settings)
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    api = Api(client, ADMIN_TOKEN)
    try:
        tokens = {"admin": ADMIN_TOKEN}
        kinds = {
            "asker": "agent",
            "other_agent": "agent",
            "target": "user",
            "member": "user",
            "outsider": "user",
        }
        for who, kind in kinds.items():
            tokens[who] = await api.principal(WHO[who] or "", kind)
        await api.room("ops", ["mona"])
        revoked = {}
        for who in kinds:
            issued = await api.call("POST", f"/v1/admin/principals/{WHO[who]}/tokens", ADMIN_TOKEN)
            gone = await api.call("DELETE", f"/v1/admin/tokens/{issued.body['token_id']}", ADMIN_TOKEN)
            assert gone.status == 204
            revoked[who] = issued.body["token"]
        yield World(client, redis, Keys(settings.key_prefix), tokens, revoked)
    finally:
        await close_client(client)
        await redis.aclose()


def entitled(route: str, who: str, scope: str) -> bool:
    """May this caller change the question's state with this route? (The spec's rules.)"""
    if route == "answer":
        return (scope, who) in {("direct", "target"), ("room", "member")}
    if route == "cancel":
        return who in ("asker", "admin")
    return False


def tamper(token: str, position: int, replacement: str) -> str:
    """The token with one character changed (never to itself)."""
    i = position % len(token)
    new = replacement if replacement != token[i] else ("A" if token[i] != "A" else "B")
    return token[:i] + new + token[i + 1 :]


async def attempt(
    world: World,
    route: str,
    question_id: str,
    authorization: str | None,
    *,
    body: Any = None,
    query: str = "",
    headers: dict[str, str] | None = None,
    as_msgpack: bool = False,
    raw: bytes | None = None,
) -> tuple[int, Any]:
    method, path = ROUTES[route]
    path = path.format(id=question_id)
    if query:
        path += ("&" if "?" in path else "?") + query
    sent = dict(headers or {})
    if authorization is not None:
        sent["Authorization"] = authorization
    if method == "POST" and body is None and raw is None:
        body = {"option": "yes"} if route == "answer" else {"reason": "attack"}
    reply = await send(
        world.client,
        method,
        path,
        body=body,
        raw=raw,
        headers=sent,
        msgpack_body=as_msgpack,
        content_type="application/msgpack" if raw is not None else None,
    )
    assert reply.status != 500, reply.data
    return reply.status, reply.body


NO_CHANGE = HealthCheck.function_scoped_fixture
TOKEN_STATES = ["valid", "tampered first", "tampered middle", "tampered last", "revoked", "none", "basic"]


def authorization_for(
    world: World, who: str, token_state: str, position: int = 0, char: str = "x"
) -> str | None:
    """The Authorization header a caller sends: its token as issued, one character changed,
    a revoked token of the same principal, none, or its token under another scheme."""
    token = world.tokens[who]
    spots = {"tampered first": 0, "tampered middle": len(token) // 2, "tampered last": len(token) - 1}
    if token_state == "valid":
        return f"Bearer {token}"
    if token_state == "tampered":
        return f"Bearer {tamper(token, position, char)}"
    if token_state in spots:
        return f"Bearer {tamper(token, spots[token_state], char)}"
    if token_state == "revoked":
        return None if who == "admin" else f"Bearer {world.revoked[who]}"
    if token_state == "none":
        return None
    return f"Basic {token}"


async def check_no_unauthorized_change(
    world: World, route: str, who: str, scope: str, token_state: str, authorization: str | None
) -> None:
    """One call on a fresh question, and the invariant: the hash is unchanged unless the caller,
    with a valid token, was entitled to change it, and then the story names the caller."""
    question_id = await world.ask({"user": "tess"} if scope == "direct" else {"room": "ops"})
    before = await world.stored(question_id)
    status, body = await attempt(world, route, question_id, authorization)
    after = await world.stored(question_id)
    if token_state != "valid":
        assert status == 401, body
    if token_state != "valid" or not entitled(route, who, scope):
        assert after == before, f"{route} by {who} ({token_state}) changed {question_id}"
        if route in ("answer", "cancel"):
            assert status >= 400 or body["applied"] is False
        return
    assert status == 200, body
    assert body["applied"] is True
    if route == "answer":
        assert after["ans_by"] == WHO[who]
    else:
        assert after["cancel_by"] == (WHO[who] or "admin")


@pytest.mark.parametrize("scope", ["direct", "room"])
@pytest.mark.parametrize("who", list(WHO))
@pytest.mark.parametrize("route", list(ROUTES))
async def test_every_route_principal_and_scope_under_every_token_attack(
    world: World, route: str, who: str, scope: str
) -> None:
    """Invariant, for one route x principal kind x scope, under each of: the token as issued,
    tampered in its first, middle or last character, revoked, absent, or sent as Basic: no call
    changes a question its caller may not change (the asker owns every question here, so the
    other agent is the non-owner), a bad token is a 401, and an entitled call names its caller."""
    for token_state in TOKEN_STATES:
        authorization = authorization_for(world, who, token_state)
        await check_no_unauthorized_change(world, route, who, scope, token_state, authorization)


async def test_no_token_attack_creates_a_question(world: World) -> None:
    """Invariant: a create with a tampered, revoked, absent or Basic token, or by a principal
    that is not an agent, creates nothing (the stats count no creation)."""
    for who in WHO:
        for token_state in TOKEN_STATES:
            if token_state == "valid" and who in ("asker", "other_agent"):
                continue
            before = await created_count(world)
            headers = {}
            authorization = authorization_for(world, who, token_state)
            if authorization is not None:
                headers["Authorization"] = authorization
            reply = await send(
                world.client, "POST", "/v1/questions", body=question_body({"user": "tess"}), headers=headers
            )
            assert reply.status in (401, 403), (who, token_state, reply.data)
            assert await created_count(world) == before, f"create by {who} ({token_state})"


async def created_count(world: World) -> int:
    total = 0
    for b in range(BUCKETS):
        total += int(await world.redis.hget(world.keys.stats(b), "created") or 0)
    return total


@settings(max_examples=60, deadline=None, suppress_health_check=[NO_CHANGE])
@given(
    route=st.sampled_from(list(ROUTES)),
    who=st.sampled_from(list(WHO)),
    scope=st.sampled_from(["direct", "room"]),
    position=st.integers(min_value=0, max_value=200),
    replacement=st.characters(min_codepoint=0x20, max_codepoint=0x7E),
)
async def test_a_token_tampered_anywhere_changes_nothing(
    world: World, route: str, who: str, scope: str, position: int, replacement: str
) -> None:
    """Invariant: a token with any one character replaced by any ASCII character is refused
    (401) and the question's hash is unchanged, on every route, for every principal kind."""
    authorization = authorization_for(world, who, "tampered", position, replacement)
    await check_no_unauthorized_change(world, route, who, scope, "tampered", authorization)


SMUGGLE_WAYS = ["body", "msgpack body", "query", "header", "msgpack ext field", "msgpack ext value"]
BASE_BODY = {"answer": {"option": "yes"}, "cancel": {"reason": "smuggled"}}


def smuggling(route: str, way: str, field: str, header: str, smuggled: str, ext_code: int) -> dict[str, Any]:
    """The `attempt` arguments that hide `smuggled` as an identity in one way."""
    base = BASE_BODY[route]
    if way == "body":
        return {"body": {**base, field: smuggled}}
    if way == "msgpack body":
        return {"body": {**base, field: smuggled}, "as_msgpack": True}
    if way == "query":
        return {"query": f"{field}={smuggled}"}
    if way == "header":
        return {"headers": {header: smuggled}}
    ext = msgpack.ExtType(ext_code, json.dumps({field: smuggled}).encode())
    if way == "msgpack ext field":
        return {"raw": msgpack.packb({**base, field: ext}, use_bin_type=True)}
    value_of = next(iter(base))  # the route's one field, its value replaced by the extension
    return {"raw": msgpack.packb({**base, value_of: ext}, use_bin_type=True)}


@settings(max_examples=80, deadline=None, suppress_health_check=[NO_CHANGE])
@given(
    route=st.sampled_from(["answer", "cancel"]),
    who=st.sampled_from(list(WHO)),
    scope=st.sampled_from(["direct", "room"]),
    way=st.sampled_from(SMUGGLE_WAYS),
    field=st.sampled_from(sorted(IDENTITY_FIELDS)),
    header=st.sampled_from(IDENTITY_HEADERS),
    smuggled=st.sampled_from(SMUGGLED),
    ext_code=st.integers(min_value=0, max_value=127),
)
async def test_a_smuggled_identity_never_acts_for_anyone(
    world: World,
    route: str,
    who: str,
    scope: str,
    way: str,
    field: str,
    header: str,
    smuggled: str,
    ext_code: int,
) -> None:
    """Invariant: an answer or cancel that names an identity in its body (JSON or msgpack), its
    query, a header, or hides one in a msgpack extension type (as a field or as the value) is
    either refused with a 4xx and changes nothing, or (a header, which the service ignores) is
    taken as the token owner's own call: the stored responder or canceller is always the
    token's principal, and a caller not entitled to the call changes nothing, whoever it names."""
    question_id = await world.ask({"user": "tess"} if scope == "direct" else {"room": "ops"})
    before = await world.stored(question_id)
    authorization = f"Bearer {world.tokens[who]}"
    kwargs = smuggling(route, way, field, header, smuggled, ext_code)
    status, body = await attempt(world, route, question_id, authorization, **kwargs)
    after = await world.stored(question_id)
    if way != "header":
        assert 400 <= status < 500, body
    if status >= 400 or not entitled(route, who, scope):
        assert after == before, f"{route} by {who} smuggling {smuggled} via {way} changed {question_id}"
        return
    assert status == 200, body
    assert body["applied"] is True
    if route == "answer":
        assert after["ans_by"] == WHO[who]
        assert body["question"]["answer"]["responder"] == WHO[who]
    else:
        assert after["cancel_by"] == (WHO[who] or "admin")
        assert body["question"]["cancellation"]["by"] == (WHO[who] or "admin")
