"""HTTP handlers: parse, call the domain, shape the reply. One routes table at the bottom."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from service import bodies
from service.bodies import IDENTITY_FIELDS
from service.errors import (
    ActionUsed,
    Forbidden,
    IdentityInBody,
    Invalid,
    NotFound,
    TooManyStreams,
    Unauthenticated,
    Unavailable,
)
from service.events import stream_id
from service.http.appkeys import (
    ACTIONS,
    DELIVERIES,
    DELIVERY_WORKERS,
    DIRECTORY,
    EVENT_HUB,
    METRICS,
    QUESTIONS,
    REDIS,
    SCRIPTS,
    SETTINGS,
    WEBHOOKS,
)
from service.http.codec import read_body, respond
from service.http.openapi import openapi_json
from service.http.web import inbox, web_file
from service.keys import Keys
from service.logs import REQUEST_ID, REQUEST_ID_HEADER, note
from service.model import IDENTIFIER, Kind, Principal, State
from service.pings import require_user
from service.questions import Outcome
from service.stats import LOSSY, redis_checks, warnings_of

PRINCIPAL = web.RequestKey("principal", Principal)
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*\"?(\d+(?:\.\d+)?)\"?\s*(?:[,;]|$)", re.IGNORECASE)
_DIGITS = re.compile(r"^[0-9]{1,9}\Z")
# A JSON number's digits (the OpenAPI type is number), not negative, as float() alone would not.
_SECONDS = re.compile(r"^(?=.{1,32}\Z)[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_IDEMPOTENCY_KEY = re.compile(r'^"?([\x21\x23-\x7e]{1,255})"?$')

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every /v1 route needs `Authorization: Bearer <token>`; the principal comes from it alone.
    The one exception is a Ping's action link, whose signed token is its own authentication."""
    if request.path.startswith("/v1/actions/"):
        check_query(request)
    elif request.path.startswith("/v1/"):
        principal = await request.app[DIRECTORY].authenticate(bearer_token(request))
        if principal is None:
            raise Unauthenticated("the token is unknown, revoked or expired")
        request[PRINCIPAL] = principal
        check_query(request)
    return await handler(request)


async def still_authenticated(request: web.Request) -> None:
    """After a long poll: a token revoked (or expired) while it was parked gets no answer. The
    revoking process knows at once; others within QS_AUTH_CACHE_SECONDS, as for any request."""
    if await request.app[DIRECTORY].authenticate(bearer_token(request)) is None:
        raise Unauthenticated("the token was revoked or expired while the request waited")


def bearer_token(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("send Authorization: Bearer <token>")
    if len(request.headers.getall("Authorization")) > 1:  # a proxy may have checked the other
        raise Unauthenticated("send one Authorization header, not several")
    return token.strip()


def check_query(request: web.Request) -> None:
    """Refuse query parameters a route does not take, rather than silently ignoring them."""
    if not request.rel_url.raw_query_string:
        return  # most requests: parsing an empty query cost ~3 µs of a fetch under load
    if request.match_info.http_exception is not None:
        return  # no route matched: the 404 or 405 (with Allow) says more than the query would
    smuggled = IDENTITY_FIELDS & set(request.query)
    if smuggled and request.path.endswith("/answer"):
        raise IdentityInBody(f"remove {sorted(smuggled)}: the responder is the token's owner")
    allowed = QUERY.get(request.match_info.route.handler, frozenset())
    unknown = set(request.query) - allowed
    if unknown:
        raise Invalid(f"unknown query parameters {sorted(unknown)}; allowed: {sorted(allowed)}")
    if len(request.query) > len(set(request.query)):
        # Every parameter takes one value; which of two would win is not a thing to guess.
        repeated = sorted({name for name in request.query if len(request.query.getall(name)) > 1})
        raise Invalid(f"query parameters {repeated} are given more than once")


def outcome_reply(outcome: Outcome) -> dict[str, Any]:
    return {"applied": outcome.applied, "question": outcome.question}


# -- questions ----------------------------------------------------------------------------------


async def ask(request: web.Request) -> web.Response:
    body = bodies.convert(await read_body(request), bodies.Ask)
    if body.webhook_url is not None:
        request.app[WEBHOOKS].policy.check_url(body.webhook_url)
    key = idempotency_key(request)
    question, created = await request.app[QUESTIONS].ask(request[PRINCIPAL], body, key)
    note(request, outcome="created" if created else "replayed", question_id=question.id)
    headers = {"Location": f"/v1/questions/{question.id}"}
    if question.fields.get("hook_secret"):
        # Not in the envelope, which every path returns alike: shown to the asker here only.
        headers["Webhook-Secret"] = question.fields["hook_secret"]
    return respond(request, question, status=201 if created else 200, headers=headers)


async def me(request: web.Request) -> web.Response:
    """Who the token belongs to (the web inbox tells my answers from others' by it)."""
    return respond(request, {"principal": request[PRINCIPAL].public()})


async def get_question(request: web.Request) -> web.Response:
    question = await request.app[QUESTIONS].get(request[PRINCIPAL], request.match_info["id"])
    return respond(request, question)


async def list_questions(request: web.Request) -> web.Response:
    q = request.query
    state = choice(q.get("state"), [s.value for s in State], "state")
    role = choice(q.get("role"), ["asker", "responder"], "role")
    page = await request.app[QUESTIONS].list_page(
        request[PRINCIPAL],
        role=role,
        state=State(state) if state else None,
        room=q.get("room") or None,
        limit=bounded_int(q.get("limit"), "limit", 1, 200, default=50),
        cursor=q.get("cursor") or None,
    )
    return respond(request, {"items": page.items, "next_cursor": page.next_cursor})


async def answer(request: web.Request) -> web.Response:
    body = bodies.convert(await read_body(request), bodies.Answer)
    key = idempotency_key(request)
    outcome = await request.app[QUESTIONS].answer(
        request[PRINCIPAL], request.match_info["id"], body.option, key
    )
    note(request, outcome="applied" if outcome.applied else "stale")
    return respond(request, outcome_reply(outcome))


async def cancel(request: web.Request) -> web.Response:
    body = bodies.convert(await read_body(request, optional=True), bodies.Cancel)
    key = idempotency_key(request)
    outcome = await request.app[QUESTIONS].cancel(
        request[PRINCIPAL], request.match_info["id"], body.reason, key
    )
    note(request, outcome="applied" if outcome.applied else "stale")
    return respond(request, outcome_reply(outcome))


async def wait(request: web.Request) -> web.Response:
    timeout, preferred = wait_seconds(request)
    question = await request.app[QUESTIONS].wait(request[PRINCIPAL], request.match_info["id"], timeout)
    await still_authenticated(request)
    headers = {"Preference-Applied": f"wait={timeout:g}"} if preferred else {}
    return respond(request, question, headers=headers)


async def wait_many(request: web.Request) -> web.Response:
    body = bodies.convert(await read_body(request), bodies.WaitMany)
    settings = request.app[SETTINGS]
    timeout = min(
        settings.wait_default_seconds if body.timeout is None else body.timeout,
        settings.wait_max_seconds,
    )
    questions, met = await request.app[QUESTIONS].wait_many(
        request[PRINCIPAL], body.ids, timeout, every=body.mode == "all"
    )
    await still_authenticated(request)
    return respond(request, {"items": questions, "mode": body.mode, "condition_met": met})


def wait_seconds(request: web.Request) -> tuple[float, bool]:
    """`?timeout=S` or else `Prefer: wait=S` (RFC 7240), clamped to the configured maximum, and
    whether the preference was the one applied. A preference without a usable wait value is
    ignored, as RFC 7240 asks of preferences a server cannot comply with; a bad `?timeout` is 422."""
    settings = request.app[SETTINGS]
    raw = request.query.get("timeout")
    preferred = None if raw is not None else _PREFER_WAIT.search(request.headers.get("Prefer", ""))
    if preferred is not None:
        # Digits only, so always a number; one too long for a float (inf) just asks for the most.
        return min(float(preferred.group(1)), settings.wait_max_seconds), True
    if raw is None:
        return settings.wait_default_seconds, False
    # float() also takes "1_0", "+2", " 2 ", full-width digits, "nan" and "inf".
    seconds = float(raw) if _SECONDS.match(raw) else float("inf")
    if seconds == float("inf"):  # a spelling float() alone would take, or beyond a float
        raise Invalid("timeout must be a non-negative number of seconds, like 30 or 0.5")
    return min(seconds, settings.wait_max_seconds), False


def idempotency_key(request: web.Request) -> str | None:
    raw = request.headers.get("Idempotency-Key")
    if raw is None:
        return None
    if len(request.headers.getall("Idempotency-Key")) > 1:  # which one was meant is not a guess
        raise Invalid("send one Idempotency-Key header, not several")
    match = _IDEMPOTENCY_KEY.match(raw.strip())
    if not match:
        raise Invalid("Idempotency-Key must be 1-255 visible ASCII characters")
    return match.group(1)


def choice(value: str | None, allowed: list[str], name: str) -> str | None:
    if value is None or value == "":
        return None
    if value not in allowed:
        raise Invalid(f"{name} must be one of {allowed}")
    return value


def bounded_int(value: str | None, name: str, low: int, high: int, *, default: int) -> int:
    if value is None:
        return default
    if not _DIGITS.match(value) or not low <= int(value) <= high:
        raise Invalid(f"{name} must be an integer from {low} to {high}")
    return int(value)


# -- events -------------------------------------------------------------------------------------

_STREAM_ID = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}\Z")


def valid_stream_id(text: str) -> bool:
    """A Redis stream id: two 64-bit unsigned parts. A larger one fails the hub's shared XREAD
    for every subscriber of the process, not just its sender."""
    return bool(_STREAM_ID.match(text)) and all(int(p) < 2**64 for p in text.split("-"))


async def events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events for the caller: question.created for what now waits for them,
    question.resolved (the terminal envelope) for what they asked or could answer."""
    principal = request[PRINCIPAL]
    hub = request.app[EVENT_HUB]
    last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if last is not None and not valid_stream_id(last):
        raise Invalid("Last-Event-ID must be an id this stream sent (like 1700000000000-0)")
    latest = await hub.latest_id(principal.id)
    # An id beyond the stream's newest (it came from a Redis that lost data since, or was made
    # up) would hold back every event until the clock passed it; resume from the newest instead.
    position = latest if last is None or stream_id(last) > stream_id(latest) else last
    limit = request.app[SETTINGS].sse_streams_per_principal
    if hub.streams_of(principal.id) >= limit:  # checked and taken with no await between
        raise TooManyStreams(f"{principal.id!r} has {limit} open event streams in this process; close one")
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if request.method == "HEAD":  # the stream's status and headers, no stream (nor its slot)
        return web.Response(headers=headers, content_type="text/event-stream")
    subscriber = hub.subscribe(principal.id, position)
    heartbeat = request.app[SETTINGS].sse_heartbeat_seconds
    token, directory = bearer_token(request), request.app[DIRECTORY]
    response = web.StreamResponse(headers=headers)
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]  # prepared here, not in the middleware
    response.content_type = "text/event-stream"
    try:
        await response.prepare(request)
        await response.write(b"retry: 2000\n\n")
        while True:
            try:
                event = await asyncio.wait_for(subscriber.queue.get(), heartbeat)
            except TimeoutError:
                frame = b": keep-alive\n\n"
            else:
                if event is None:
                    break
                frame = f"id: {event.id}\nevent: {event.type}\ndata: {event.data}\n\n".encode()
            # A token revoked (or expired) while the stream is open ends it before the next
            # write; the client's reconnect then gets the 401. (A cache hit costs ~1 µs.)
            if await directory.authenticate(token) is None:
                break
            await response.write(frame)
    except (ConnectionResetError, ConnectionError):
        pass  # the client left; it resumes with Last-Event-ID
    finally:
        hub.unsubscribe(subscriber)
    return response


# -- webhooks -----------------------------------------------------------------------------------


async def create_webhook(request: web.Request) -> web.Response:
    body = bodies.convert(await read_body(request), bodies.NewWebhook)
    hook = await request.app[WEBHOOKS].create(request[PRINCIPAL].id, body.url, list(body.events))
    location = f"/v1/webhooks/{hook.id}"
    return respond(request, hook.with_secret(), status=201, headers={"Location": location})


async def list_webhooks(request: web.Request) -> web.Response:
    hooks = await request.app[WEBHOOKS].of_owner(request[PRINCIPAL].id)
    return respond(request, {"webhooks": [hook.public() for hook in hooks]})


async def get_webhook(request: web.Request) -> web.Response:
    hook = await request.app[WEBHOOKS].get(request[PRINCIPAL].id, request.match_info["id"])
    return respond(request, hook.public())


async def rotate_webhook(request: web.Request) -> web.Response:
    hook = await request.app[WEBHOOKS].rotate(request[PRINCIPAL].id, request.match_info["id"])
    return respond(request, hook.with_secret())


async def delete_webhook(request: web.Request) -> web.Response:
    await request.app[WEBHOOKS].delete(request[PRINCIPAL].id, request.match_info["id"])
    return web.Response(status=204)


async def list_deliveries(request: web.Request) -> web.Response:
    hook = await request.app[WEBHOOKS].get(request[PRINCIPAL].id, request.match_info["id"])
    limit = bounded_int(request.query.get("limit"), "limit", 1, 200, default=50)
    return respond(request, {"deliveries": await request.app[DELIVERIES].for_webhook(hook.id, limit)})


async def list_dead_letters(request: web.Request) -> web.Response:
    require_admin(request)
    limit = bounded_int(request.query.get("limit"), "limit", 1, 200, default=50)
    return respond(request, {"deliveries": await request.app[DELIVERIES].dead_letters(limit)})


async def replay_dead_letter(request: web.Request) -> web.Response:
    require_admin(request)
    return respond(request, {"delivery": await request.app[DELIVERIES].replay(request.match_info["id"])})


# -- Pings: channels and action links -------------------------------------------------------------


async def put_channel(request: web.Request) -> web.Response:
    principal = request[PRINCIPAL]
    require_user(principal.kind)
    body = bodies.convert(await read_body(request), bodies.NewChannel)
    name = request.match_info["name"]
    if not IDENTIFIER.match(name):
        raise Invalid("a channel name is 1-64 of a-z 0-9 . _ - and starts with a letter or digit")
    channel = await request.app[DELIVERY_WORKERS].channels.put(principal.id, name, body)
    reply = channel.public() | ({"secret": channel.secret} if channel.secret else {})
    return respond(request, reply)


async def list_channels(request: web.Request) -> web.Response:
    principal = request[PRINCIPAL]
    require_user(principal.kind)
    channels = await request.app[DELIVERY_WORKERS].channels.of_user(principal.id)
    return respond(request, {"channels": [c.public() for c in channels]})


async def delete_channel(request: web.Request) -> web.Response:
    principal = request[PRINCIPAL]
    require_user(principal.kind)
    await request.app[DELIVERY_WORKERS].channels.delete(principal.id, request.match_info["name"])
    return web.Response(status=204)


async def webpush_key(request: web.Request) -> web.Response:
    key = await request.app[DELIVERY_WORKERS].server_keys.vapid_public_key()
    return respond(request, {"public_key": key})


async def act(request: web.Request) -> web.Response:
    """A Ping's button: the signed link is the authentication; answers as its user, once.

    A tap after one that answered is a 409 that carries the question as it is now, so it still
    shows the resolved state; a tap whose answer did not complete (Redis unreachable, or the
    client hung up) marks nothing, so the same button can be tapped again. A second tap that
    arrives while the first still runs (a phone delivering one tap twice) runs the same keyed
    answer and is told the same outcome."""
    token = request.match_info["token"]
    actions, questions = request.app[ACTIONS], request.app[QUESTIONS]
    claim, user, used = await actions.verify(token)
    if used:
        question = await questions.as_the_link_left_it(claim.question)
        raise ActionUsed("each action link answers once; this one already did", question=question.envelope())
    # Keyed by the link: a retry of a tap whose reply was lost is told it applied.
    outcome = await questions.answer_by_link(user, claim.question, claim.option, "action:" + token)
    await actions.mark_used(claim, token)
    return respond(request, outcome_reply(outcome))


# -- admin --------------------------------------------------------------------------------------


def require_admin(request: web.Request) -> None:
    if request[PRINCIPAL].kind is not Kind.ADMIN:
        raise Forbidden("admin routes need an admin token")


async def create_principal(request: web.Request) -> web.Response:
    require_admin(request)
    body = bodies.convert(await read_body(request), bodies.NewPrincipal)
    principal = Principal(body.id, Kind(body.kind), body.display_name)
    issued = await request.app[DIRECTORY].create_principal(principal)
    return respond(
        request,
        {"principal": principal.public(), "token": issued.token, "token_id": issued.token_id},
        status=201,
        headers={"Location": f"/v1/admin/principals/{principal.id}"},
    )


async def get_principal(request: web.Request) -> web.Response:
    require_admin(request)
    principal = await request.app[DIRECTORY].require_principal(request.match_info["id"])
    return respond(request, principal.public())


async def issue_token(request: web.Request) -> web.Response:
    require_admin(request)
    body = bodies.convert(await read_body(request, optional=True), bodies.NewToken)
    issued = await request.app[DIRECTORY].issue_token(request.match_info["id"], body.expires_in)
    reply = {
        "principal": issued.principal.public(),
        "token": issued.token,
        "token_id": issued.token_id,
        "expires_in": issued.expires_in,
    }
    return respond(request, reply, status=201)


async def revoke_token(request: web.Request) -> web.Response:
    require_admin(request)
    reference = request.match_info["ref"]
    if not await request.app[DIRECTORY].revoke_token(reference):
        raise NotFound(f"no token {reference!r}")
    return web.Response(status=204)


async def put_room(request: web.Request) -> web.Response:
    require_admin(request)
    body = bodies.convert(await read_body(request), bodies.RoomMembers)
    room = request.match_info["room"]
    members = await request.app[DIRECTORY].set_members(room, body.members)
    return respond(request, {"room": room, "members": members})


async def get_room(request: web.Request) -> web.Response:
    require_admin(request)
    room = request.match_info["room"]
    return respond(request, {"room": room, "members": await request.app[DIRECTORY].members(room)})


async def put_member(request: web.Request) -> web.Response:
    require_admin(request)
    room, user = request.match_info["room"], request.match_info["user"]
    await request.app[DIRECTORY].add_member(room, user)
    return respond(request, {"room": room, "members": await request.app[DIRECTORY].members(room)})


async def delete_member(request: web.Request) -> web.Response:
    require_admin(request)
    room, user = request.match_info["room"], request.match_info["user"]
    if not await request.app[DIRECTORY].remove_member(room, user):
        raise NotFound(f"{user!r} is not a member of room {room!r}")
    return web.Response(status=204)


# -- health -------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return respond(request, {"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when Redis answers and every script is loaded (loading them if Redis lost them).
    The body lists the Redis settings checks; a setting that can lose questions is a warning,
    or, with QS_READY_REQUIRES_SAFE_REDIS, makes the process not ready."""
    scripts = request.app[SCRIPTS]
    settings = request.app[SETTINGS]
    await request.app[REDIS].ping()
    if not await scripts.loaded():
        await scripts.load_all()
    checks = await redis_checks(request.app[REDIS], settings)
    lossy = [c for c in checks if c.state in LOSSY]
    if lossy and settings.ready_requires_safe_redis:
        raise Unavailable("Redis settings can lose questions: " + "; ".join(warnings_of(lossy)))
    body = {
        "status": "ready",
        "checks": {c.name: c.public() for c in checks},
        "warnings": warnings_of(checks),
    }
    return respond(request, body)


async def metrics(request: web.Request) -> web.Response:
    return await metrics_reply(request.app, request)


async def metrics_reply(app: web.Application, request: web.Request) -> web.Response:
    """Prometheus text (or OpenMetrics, by Accept), after reading the Redis-wide figures."""
    settings = app[SETTINGS]
    registry = app[METRICS]
    await registry.refresh_from_redis(app[REDIS], Keys(settings.key_prefix), settings.redis_timeout_seconds)
    body, content_type = registry.render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


QUERY: dict[Any, frozenset[str]] = {
    list_questions: frozenset({"state", "role", "room", "limit", "cursor"}),
    wait: frozenset({"timeout"}),
    events: frozenset({"last_event_id"}),
    list_deliveries: frozenset({"limit"}),
    list_dead_letters: frozenset({"limit"}),
}

ROUTES = [
    web.get("/healthz", healthz),
    web.get("/readyz", readyz),
    web.get("/metrics", metrics),
    web.get("/openapi.json", openapi_json),
    web.get("/", inbox),
    web.get("/web/{name}", web_file),
    web.get("/v1/me", me),
    web.post("/v1/questions", ask),
    web.get("/v1/questions", list_questions),
    web.post("/v1/questions/wait", wait_many),
    web.get("/v1/questions/{id}", get_question),
    web.post("/v1/questions/{id}/answer", answer),
    web.post("/v1/questions/{id}/cancel", cancel),
    web.get("/v1/questions/{id}/wait", wait),
    web.get("/v1/events", events),
    web.post("/v1/webhooks", create_webhook),
    web.get("/v1/webhooks", list_webhooks),
    web.post("/v1/webhooks/{id}/rotate", rotate_webhook),
    web.get("/v1/webhooks/{id}", get_webhook),
    web.delete("/v1/webhooks/{id}", delete_webhook),
    web.get("/v1/webhooks/{id}/deliveries", list_deliveries),
    web.get("/v1/admin/deadletters", list_dead_letters),
    web.post("/v1/admin/deadletters/{id}/replay", replay_dead_letter),
    web.put("/v1/me/channels/{name}", put_channel),
    web.get("/v1/me/channels", list_channels),
    web.delete("/v1/me/channels/{name}", delete_channel),
    web.get("/v1/webpush/key", webpush_key),
    web.post("/v1/actions/{token}", act),
    web.post("/v1/admin/principals", create_principal),
    web.get("/v1/admin/principals/{id}", get_principal),
    web.post("/v1/admin/principals/{id}/tokens", issue_token),
    web.delete("/v1/admin/tokens/{ref}", revoke_token),
    web.put("/v1/admin/rooms/{room}", put_room),
    web.get("/v1/admin/rooms/{room}", get_room),
    web.put("/v1/admin/rooms/{room}/members/{user}", put_member),
    web.delete("/v1/admin/rooms/{room}/members/{user}", delete_member),
]
