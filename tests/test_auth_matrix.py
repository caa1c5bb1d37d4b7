"""Authorization matrix: every route x every principal kind x owner / not owner.

Statuses follow the issue: 401 for a missing, unknown, revoked or expired token; 404 when the
caller may not see the question (existence is not leaked); 403 when it may see it but its kind
or role may not do this. Every refused call (and every read) must leave Redis unchanged.

One world (principals, tokens, a room) is built once for the module, so the expired token needs
one short sleep, not one per case; each case creates its own questions.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from service.http.routes import ROUTES
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_contract import (
    Raw,
    Unchanged,
    assert_envelope,
    assert_problem,
    question_body,
    send,
)
from tests.redis_server import RedisServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Who calls. The first seven carry a valid token; the last four do not.
ASKER = "asker"  # the agent that asked: the owner of every question in this module
OTHER_AGENT = "other_agent"  # an agent that did not ask
TARGET_USER = "target_user"  # the user a direct question is aimed at (in no room)
ROOM_MEMBER = "room_member"  # a member of the room a room question is aimed at
OUTSIDER = "outsider"  # a user who is neither target nor member
ADMIN = "admin"  # the bootstrap admin token (QS_ADMIN_TOKEN)
ADMIN_PRINCIPAL = "admin_principal"  # a principal created with kind admin
NO_TOKEN = "no_token"
GARBAGE_TOKEN = "garbage_token"
REVOKED_TOKEN = "revoked_token"  # the asker's own token, revoked: an owner without a valid token
EXPIRED_TOKEN = "expired_token"  # the target user's own token, past its expires_in

VALID = [ASKER, OTHER_AGENT, TARGET_USER, ROOM_MEMBER, OUTSIDER, ADMIN, ADMIN_PRINCIPAL]
DEAD = [NO_TOKEN, GARBAGE_TOKEN, REVOKED_TOKEN, EXPIRED_TOKEN]
EVERYONE = VALID + DEAD
AGENTS = {ASKER, OTHER_AGENT}
USERS = {TARGET_USER, ROOM_MEMBER, OUTSIDER}
ADMINS = {ADMIN, ADMIN_PRINCIPAL}

IDS = {
    ASKER: "asker-bot",
    OTHER_AGENT: "other-bot",
    TARGET_USER: "tess",
    ROOM_MEMBER: "mona",
    OUTSIDER: "olaf",
    ADMIN_PRINCIPAL: "ada",
    REVOKED_TOKEN: "asker-bot",
    EXPIRED_TOKEN: "tess",
}
ROOM = "ops"
MISSING_ID = "f" * 25  # well formed, never created


@dataclass
class World:
    api: Api
    tokens: dict[str, str | None] = field(default_factory=dict)
    counter: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def client(self) -> TestClient[Any, Any]:
        return self.api.client

    def unique(self, stem: str) -> str:
        return f"{stem}-{next(self.counter)}"

    async def call(self, who: str, method: str, path: str, body: Any = None) -> Raw:
        headers = {}
        token = self.tokens[who]
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return await send(self.client, method, path, body=body, headers=headers)

    async def admin(self, method: str, path: str, body: Any = None) -> Raw:
        reply = await send(self.client, method, path, ADMIN_TOKEN, body=body)
        assert reply.status < 300, (method, path, reply.data)
        return reply

    async def ask(self, to: dict[str, str]) -> str:
        reply = await send(
            self.client, "POST", "/v1/questions", self.tokens[ASKER], body=question_body(to, expires_in=3600)
        )
        assert reply.status == 201, reply.data
        question_id: str = reply.body["id"]
        return question_id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(redis_server: RedisServer) -> AsyncIterator[World]:
    client = await start_client(settings_for(redis_server.url))
    api = Api(client, ADMIN_TOKEN)
    w = World(api)
    try:
        # The expired token first, so its second passes while the rest is set up.
        tess = await api.principal("tess", "user")
        short = await w.admin("POST", "/v1/admin/principals/tess/tokens", {"expires_in": 1})
        expires = asyncio.get_running_loop().time() + 1
        w.tokens.update(
            {
                TARGET_USER: tess,
                ASKER: await api.principal("asker-bot", "agent"),
                OTHER_AGENT: await api.principal("other-bot", "agent"),
                ROOM_MEMBER: await api.principal("mona", "user"),
                OUTSIDER: await api.principal("olaf", "user"),
                ADMIN: ADMIN_TOKEN,
                ADMIN_PRINCIPAL: await api.principal("ada", "admin"),
                NO_TOKEN: None,
                GARBAGE_TOKEN: "qs_0123456789ab_" + "x" * 43,
            }
        )
        await api.room(ROOM, ["mona"])
        spare = await w.admin("POST", "/v1/admin/principals/asker-bot/tokens")
        await w.admin("DELETE", f"/v1/admin/tokens/{spare.body['token_id']}")
        w.tokens[REVOKED_TOKEN] = spare.body["token"]
        w.tokens[EXPIRED_TOKEN] = short.body["token"]
        # The short token worked, the revoked one no longer does.
        assert (await w.call(EXPIRED_TOKEN, "GET", "/v1/questions")).status == 200
        assert (await w.call(REVOKED_TOKEN, "GET", "/v1/questions")).status == 401
        await asyncio.sleep(max(0.0, expires - asyncio.get_running_loop().time()) + 0.1)
        assert (await w.call(EXPIRED_TOKEN, "GET", "/v1/questions")).status == 401
        yield w
    finally:
        await client.close()


@pytest_asyncio.fixture(loop_scope="module")
async def questions(world: World) -> dict[str, str]:
    """This case's questions: one direct to the target user, one to the room, one never made."""
    return {
        "direct": await world.ask({"user": "tess"}),
        "room": await world.ask({"room": ROOM}),
        "missing": MISSING_ID,
    }


def check_refusal(reply: Raw, status: int) -> None:
    assert_problem(reply, status)
    if status == 401:
        assert reply.headers.get("WWW-Authenticate", "").lower().startswith("bearer")


# -- question routes ----------------------------------------------------------------------------

# route -> principal -> expected status for the (direct, room, missing) question.
NOT_VISIBLE = (404, 404, 404)
QUESTION_TABLE: dict[str, dict[str, tuple[int, int, int]]] = {
    "fetch": {
        ASKER: (200, 200, 404),
        OTHER_AGENT: NOT_VISIBLE,
        TARGET_USER: (200, 404, 404),
        ROOM_MEMBER: (404, 200, 404),
        OUTSIDER: NOT_VISIBLE,
        ADMIN: (200, 200, 404),
        ADMIN_PRINCIPAL: (200, 200, 404),
    },
    "answer": {
        ASKER: (403, 403, 404),
        OTHER_AGENT: NOT_VISIBLE,
        TARGET_USER: (200, 404, 404),
        ROOM_MEMBER: (404, 200, 404),
        OUTSIDER: NOT_VISIBLE,
        ADMIN: (403, 403, 404),
        ADMIN_PRINCIPAL: (403, 403, 404),
    },
    "cancel": {
        ASKER: (200, 200, 404),
        OTHER_AGENT: NOT_VISIBLE,
        TARGET_USER: (403, 404, 404),
        ROOM_MEMBER: (404, 403, 404),
        OUTSIDER: NOT_VISIBLE,
        ADMIN: (200, 200, 404),
        ADMIN_PRINCIPAL: (200, 200, 404),
    },
}
QUESTION_TABLE["wait"] = QUESTION_TABLE["fetch"]
for _route in QUESTION_TABLE.values():
    for _dead in DEAD:
        _route[_dead] = (401, 401, 401)
SCOPES = ("direct", "room", "missing")
QUESTION_CALLS = {
    "fetch": ("GET", "/v1/questions/{id}", None),
    "wait": ("GET", "/v1/questions/{id}/wait?timeout=0", None),
    "answer": ("POST", "/v1/questions/{id}/answer", {"option": "yes"}),
    "cancel": ("POST", "/v1/questions/{id}/cancel", {"reason": "matrix"}),
}
QUESTION_CASES = [
    pytest.param(route, who, scope, QUESTION_TABLE[route][who][i], id=f"{route}-{scope}-by-{who}")
    for route in QUESTION_CALLS
    for who in EVERYONE
    for i, scope in enumerate(SCOPES)
]


@pytest.mark.parametrize(("route", "who", "scope", "status"), QUESTION_CASES)
async def test_question_route_authorization(
    world: World, questions: dict[str, str], route: str, who: str, scope: str, status: int
) -> None:
    method, path, body = QUESTION_CALLS[route]
    question_id = questions[scope]
    writes = route in ("answer", "cancel") and status == 200
    if writes:
        reply = await world.call(who, method, path.format(id=question_id), body)
    else:
        async with Unchanged(world.api, f"{route} by {who}"):
            reply = await world.call(who, method, path.format(id=question_id), body)

    if status >= 400:
        check_refusal(reply, status)
        return
    assert reply.status == status, reply.data
    if route in ("fetch", "wait"):
        assert_envelope(reply.body)
        assert reply.body["id"] == question_id
        assert reply.body["state"] == "pending"
    elif route == "answer":
        assert reply.body["applied"] is True
        assert reply.body["question"]["answer"]["responder"] == IDS[who]
    else:
        assert reply.body["applied"] is True
        by = "admin" if who == ADMIN else IDS[who]
        assert reply.body["question"]["cancellation"]["by"] == by


# -- create -------------------------------------------------------------------------------------


def create_status(who: str) -> int:
    if who in DEAD:
        return 401
    return 201 if who in AGENTS else 403


CREATE_CASES = [
    pytest.param(who, scope, create_status(who), id=f"create-{scope}-by-{who}")
    for who in EVERYONE
    for scope in ("direct", "room")
]


@pytest.mark.parametrize(("who", "scope", "status"), CREATE_CASES)
async def test_create_authorization(world: World, who: str, scope: str, status: int) -> None:
    to = {"user": "tess"} if scope == "direct" else {"room": ROOM}
    body = question_body(to)
    if status == 201:
        reply = await world.call(who, "POST", "/v1/questions", body)
        assert reply.status == 201, reply.data
        assert reply.body["asker"] == IDS[who]
        return
    async with Unchanged(world.api, f"create by {who}"):
        reply = await world.call(who, "POST", "/v1/questions", body)
    check_refusal(reply, status)


# -- list ---------------------------------------------------------------------------------------

# query -> principal -> (status, which of this case's questions the page holds)
LIST_TABLE: dict[str, dict[str, tuple[int, set[str]]]] = {
    "": {
        ASKER: (200, {"direct", "room"}),
        OTHER_AGENT: (200, set()),
        TARGET_USER: (200, {"direct"}),
        ROOM_MEMBER: (200, {"room"}),
        OUTSIDER: (200, set()),
        ADMIN: (422, set()),  # admins list one named room at a time
        ADMIN_PRINCIPAL: (422, set()),
    },
    "role=asker": {
        ASKER: (200, {"direct", "room"}),
        OTHER_AGENT: (200, set()),
        TARGET_USER: (403, set()),
        ROOM_MEMBER: (403, set()),
        OUTSIDER: (403, set()),
        ADMIN: (422, set()),
        ADMIN_PRINCIPAL: (422, set()),
    },
    "role=responder": {
        ASKER: (403, set()),
        OTHER_AGENT: (403, set()),
        TARGET_USER: (200, {"direct"}),
        ROOM_MEMBER: (200, {"room"}),
        OUTSIDER: (200, set()),
        ADMIN: (422, set()),
        ADMIN_PRINCIPAL: (422, set()),
    },
    f"room={ROOM}": {
        ASKER: (200, {"room"}),
        OTHER_AGENT: (200, set()),
        TARGET_USER: (403, set()),
        ROOM_MEMBER: (200, {"room"}),
        OUTSIDER: (403, set()),
        ADMIN: (200, {"room"}),
        ADMIN_PRINCIPAL: (200, {"room"}),
    },
}
for _query in LIST_TABLE.values():
    for _dead in DEAD:
        _query[_dead] = (401, set())
LIST_CASES = [
    pytest.param(query, who, *LIST_TABLE[query][who], id=f"list-{query or 'default'}-by-{who}")
    for query in LIST_TABLE
    for who in EVERYONE
]


@pytest.mark.parametrize(("query", "who", "status", "sees"), LIST_CASES)
async def test_list_authorization(
    world: World, questions: dict[str, str], query: str, who: str, status: int, sees: set[str]
) -> None:
    async with Unchanged(world.api, f"list ?{query} by {who}"):
        reply = await world.call(who, "GET", f"/v1/questions?limit=200&{query}")
    if status >= 400:
        check_refusal(reply, status)
        return
    assert reply.status == 200, reply.data
    listed = {item["id"] for item in reply.body["items"]}
    mine = {scope: questions[scope] for scope in ("direct", "room")}
    assert {scope for scope, question_id in mine.items() if question_id in listed} == sees
    if who in USERS:
        for item in reply.body["items"]:  # a user only ever lists what it may answer
            assert item["to"] in ({"user": IDS[who]}, {"room": ROOM} if who == ROOM_MEMBER else None)
    if who in AGENTS:
        assert all(item["asker"] == IDS[who] for item in reply.body["items"])


# -- admin routes -------------------------------------------------------------------------------

ADMIN_ROUTES = {
    # name -> (success status, whether "own" makes sense: the caller acting on itself)
    "create_principal": (201, False),
    "get_principal": (200, True),
    "issue_token": (201, True),
    "revoke_token": (204, True),
    "put_room": (200, False),
    "get_room": (200, True),
    "put_member": (200, True),
    "delete_member": (204, True),
}
# Whose "own" resource exists: principals with an identity of their own.
HAS_IDENTITY = [
    ASKER,
    OTHER_AGENT,
    TARGET_USER,
    ROOM_MEMBER,
    OUTSIDER,
    ADMIN_PRINCIPAL,
    REVOKED_TOKEN,
    EXPIRED_TOKEN,
]


def admin_status(route: str, who: str) -> int:
    if who in DEAD:
        return 401
    return ADMIN_ROUTES[route][0] if who in ADMINS else 403


ADMIN_CASES = [
    pytest.param(route, who, target, admin_status(route, who), id=f"{route}-{target}-by-{who}")
    for route, (_, has_own) in ADMIN_ROUTES.items()
    for who in EVERYONE
    for target in (["own", "other"] if has_own and who in HAS_IDENTITY else ["other"])
]


async def admin_request(world: World, route: str, who: str, target: str) -> tuple[str, str, Any]:
    """The request for one admin case, with whatever it acts on made fresh for it.
    "own": the caller's own principal, token or room; "other": someone else's."""
    subject = IDS[who] if target == "own" else "olaf"
    if route == "create_principal":
        return "POST", "/v1/admin/principals", {"id": world.unique("new"), "kind": "user"}
    if route == "get_principal":
        return "GET", f"/v1/admin/principals/{subject}", None
    if route == "issue_token":
        return "POST", f"/v1/admin/principals/{subject}/tokens", None
    if route == "revoke_token":
        issued = await world.admin("POST", f"/v1/admin/principals/{subject}/tokens")
        return "DELETE", f"/v1/admin/tokens/{issued.body['token_id']}", None
    if route == "put_room":
        return "PUT", f"/v1/admin/rooms/{world.unique('room')}", {"members": ["olaf"]}
    # Rooms the subject belongs to ("own") or not; members must be users, so agents and admins
    # get a room of their own in name only.
    room = world.unique("room")
    member = subject if subject in ("tess", "mona", "olaf") else "olaf"
    await world.admin("PUT", f"/v1/admin/rooms/{room}", {"members": [member]})
    if route == "get_room":
        return "GET", f"/v1/admin/rooms/{room}", None
    if route == "put_member":
        newcomer = "mona" if member != "mona" else "tess"
        return "PUT", f"/v1/admin/rooms/{room}/members/{newcomer}", None
    return "DELETE", f"/v1/admin/rooms/{room}/members/{member}", None


@pytest.mark.parametrize(("route", "who", "target", "status"), ADMIN_CASES)
async def test_admin_route_authorization(
    world: World, route: str, who: str, target: str, status: int
) -> None:
    method, path, body = await admin_request(world, route, who, target)
    if status < 300 and route not in ("get_room", "get_principal"):
        reply = await world.call(who, method, path, body)
        assert reply.status == status, reply.data
        return
    async with Unchanged(world.api, f"{route} by {who}"):
        reply = await world.call(who, method, path, body)
    if status >= 400:
        check_refusal(reply, status)
    else:
        assert reply.status == status, reply.data


# -- unauthenticated routes, and every /v1 route without a valid token --------------------------


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
@pytest.mark.parametrize("who", EVERYONE)
async def test_health_routes_answer_everyone(world: World, path: str, who: str) -> None:
    async with Unchanged(world.api, f"{path} by {who}"):
        reply = await world.call(who, "GET", path)
    assert reply.status == 200, reply.data


# A Ping's action link is the one /v1 route whose signed path is its own authentication
# (tests/test_pings.py checks forged, altered and replayed links).
V1_ROUTES = [
    route for route in ROUTES if route.path.startswith("/v1/") and not route.path.startswith("/v1/actions/")
]


def concrete(path: str) -> str:
    """A route pattern with every {placeholder} filled in."""
    return re.sub(r"\{(\w+)\}", lambda m: MISSING_ID if m.group(1) == "id" else "olaf", path)


@pytest.mark.parametrize("who", DEAD)
@pytest.mark.parametrize("route", V1_ROUTES, ids=[f"{r.method} {r.path}" for r in V1_ROUTES])
async def test_every_v1_route_refuses_a_missing_or_dead_token(world: World, route: Any, who: str) -> None:
    """Including routes added after issue 2: authentication comes before anything else."""
    body = {} if route.method in ("POST", "PUT") else None
    async with Unchanged(world.api, f"{route.method} {route.path} by {who}"):
        reply = await world.call(who, route.method, concrete(route.path), body)
    check_refusal(reply, 401)


@pytest.mark.parametrize("who", DEAD)
async def test_an_action_link_needs_no_token_but_a_forged_one_changes_nothing(world: World, who: str) -> None:
    async with Unchanged(world.api, f"POST /v1/actions by {who}"):
        reply = await world.call(who, "POST", "/v1/actions/eyJxIjoxfQ.c2lnbmF0dXJl", None)
    check_refusal(reply, 403)


@pytest.mark.parametrize("who", [w for w in VALID if w not in ADMINS])
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/admin/deadletters"), ("POST", "/v1/admin/deadletters/msg_0123456789abcdef/replay")],
)
async def test_dead_letter_routes_are_refused_to_everyone_but_admins(
    world: World, who: str, method: str, path: str
) -> None:
    """The listing shows every principal's failed deliveries; a replay re-sends one."""
    async with Unchanged(world.api, f"{method} {path} by {who}"):
        reply = await world.call(who, method, path, None)
    check_refusal(reply, 403)
