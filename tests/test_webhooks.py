"""Outgoing webhooks against a real receiver on 127.0.0.1: registration, Standard Webhooks
signatures, at-least-once delivery with retries, dead letters and replay, and the outbound guard."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from standardwebhooks.webhooks import Webhook as Verifier

from service.errors import Invalid, Unavailable
from service.http.appkeys import DELIVERY_WORKERS, REDIS, SETTINGS
from service.keys import BUCKETS, bucket_of, new_question_id
from service.outbound import (
    AddressRefused,
    Attempt,
    GuardedResolver,
    OutboundPolicy,
    new_session,
    parse_nets,
    post,
)
from service.settings import Settings
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.helpers_reliability import eventually
from tests.live_service import on_loopback
from tests.receivers import RecordingReceiver, recording_receiver
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis
FAST = {
    "outbound_allow_nets": "127.0.0.0/8",
    "webhook_retry_schedule": "0.1,0.1",
    "webhook_timeout_seconds": 0.5,
    "delivery_lease_seconds": 2.0,
}


@pytest.fixture
async def receiver() -> AsyncIterator[RecordingReceiver]:
    async with recording_receiver() as rec:
        yield rec


@pytest.fixture
async def api_with(redis_server: RedisServer) -> AsyncIterator[Callable[..., Awaitable[Api]]]:
    clients: list[TestClient[object, object]] = []

    async def make(settings: Settings | None = None, **changes: Any) -> Api:
        chosen = settings or test_settings(redis_server.url, **{**FAST, **changes})
        client = await start_client(chosen)
        clients.append(client)
        return Api(client, ADMIN_TOKEN)

    yield make
    for client in clients:
        await close_client(client)


async def register(api: Api, token: str, url: str, events: list[str] | None = None) -> dict[str, Any]:
    body = {"url": url, "events": events or ["question.answered"]}
    reply = await api.call("POST", "/v1/webhooks", token, body)
    assert reply.status == 201, reply.body
    result: dict[str, Any] = reply.body
    return result


async def deliveries(api: Api, token: str, hook_id: str) -> list[dict[str, Any]]:
    reply = await api.call("GET", f"/v1/webhooks/{hook_id}/deliveries", token)
    assert reply.status == 200, reply.body
    found: list[dict[str, Any]] = reply.body["deliveries"]
    return found


async def settled(api: Api, token: str, hook_id: str, status: str, within: float = 15.0) -> dict[str, Any]:
    """Poll the deliveries route until the single delivery reaches `status`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        found = await deliveries(api, token, hook_id)
        if found and found[0]["status"] == status:
            assert len(found) == 1, found
            return found[0]
        assert loop.time() < deadline, f"delivery never became {status}: {found}"
        await asyncio.sleep(0.05)


async def answered_question(api: Api, agent: str, user_id: str = "alice") -> dict[str, Any]:
    user = await api.principal(user_id, "user")
    question = await api.ask(agent, {"user": user_id})
    reply = await api.answer(user, question["id"], "yes")
    assert reply.body["applied"] is True
    final: dict[str, Any] = reply.body["question"]
    return final


async def test_registration_shows_the_secret_once_lists_without_it_rotates_and_deletes(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    other = await api.principal("otherbot", "agent")
    hook = await register(api, agent, receiver.url, ["question.answered", "question.created"])
    assert hook["secret"].startswith("whsec_")
    assert hook["id"].startswith("wh_")
    assert hook["events"] == ["question.created", "question.answered"]
    listed = (await api.call("GET", "/v1/webhooks", agent)).body["webhooks"]
    assert [h["id"] for h in listed] == [hook["id"]]
    assert "secret" not in listed[0]
    assert (await api.call("GET", f"/v1/webhooks/{hook['id']}", agent)).body == listed[0]
    assert (await api.call("GET", "/v1/webhooks", other)).body["webhooks"] == []
    rotated = await api.call("POST", f"/v1/webhooks/{hook['id']}/rotate", agent)
    assert rotated.status == 200
    assert rotated.body["secret"] not in ("", hook["secret"])
    for method, path in [
        ("POST", f"/v1/webhooks/{hook['id']}/rotate"),
        ("GET", f"/v1/webhooks/{hook['id']}"),
        ("DELETE", f"/v1/webhooks/{hook['id']}"),
        ("GET", f"/v1/webhooks/{hook['id']}/deliveries"),
    ]:
        assert (await api.call(method, path, other)).status == 404, (method, path)
    assert (await api.call("DELETE", f"/v1/webhooks/{hook['id']}", agent)).status == 204
    assert (await api.call("DELETE", f"/v1/webhooks/{hook['id']}", agent)).status == 404
    assert (await api.call("GET", f"/v1/webhooks/{hook['id']}", agent)).status == 404
    assert (await api.call("GET", "/v1/webhooks", agent)).body["webhooks"] == []


async def test_the_location_of_a_new_webhook_or_principal_can_be_read(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    body = {"url": receiver.url, "events": ["question.answered"]}
    created = await api.call("POST", "/v1/webhooks", agent, body)
    located = await api.call("GET", created.headers["Location"], agent)
    assert located.status == 200
    assert located.body == {k: v for k, v in created.body.items() if k != "secret"}
    made = await api.call("POST", "/v1/admin/principals", api.admin, {"id": "pat", "kind": "user"})
    principal = await api.call("GET", made.headers["Location"], api.admin)
    assert (principal.status, principal.body) == (200, made.body["principal"])
    assert (await api.call("GET", "/v1/admin/principals/nobody", api.admin)).status == 404


@pytest.mark.parametrize(
    "body",
    [
        {"url": "http://127.0.0.1:9/x", "events": ["question.answered"]},
        {"url": "http://localhost/x", "events": ["question.answered"]},
        {"url": "http://10.1.2.3/x", "events": ["question.answered"]},
        {"url": "http://[::1]/x", "events": ["question.answered"]},
        {"url": "http://169.254.169.254/latest/meta-data", "events": ["question.answered"]},
        {"url": "http://2130706433:9/x", "events": ["question.answered"]},
        {"url": "http://127.1:9/x", "events": ["question.answered"]},
        {"url": "http://0x7f.1:9/x", "events": ["question.answered"]},
        {"url": "http://0177.0.0.1/x", "events": ["question.answered"]},
        {"url": "http://8.8.8.8./x", "events": ["question.answered"]},
        # Other spellings that IDNA folds into loopback before the connection is made:
        {"url": "http://\uff11\uff12\uff17.0.0.1:9/x", "events": ["question.answered"]},  # full-width
        {"url": "http://\u2460\u2461\u2466.0.0.1/x", "events": ["question.answered"]},  # circled
        {"url": "http://127\u30020\u30020\u30021/x", "events": ["question.answered"]},  # ideographic '.'
        {
            "url": "http://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54/",
            "events": ["question.created"],
        },
        {
            "url": "http://\u24db\u24de\u24d2\u24d0\u24db\u24d7\u24de\u24e2\u24e3/",
            "events": ["question.created"],
        },
        {"url": "ftp://example.com/x", "events": ["question.answered"]},
        {"url": "https://user:pw@example.com/x", "events": ["question.answered"]},
        {"url": "https://example.com/x", "events": ["question.deleted"]},
        {"url": "https://example.com/x", "events": []},
        {"url": "https://example.com/" + "x" * 2100, "events": ["question.answered"]},
        {"url": "https://exa mple.com/x", "events": ["question.answered"]},
        {"url": "https://exa\u0000mple.com/x", "events": ["question.answered"]},
        {"url": "https://example.com/a\nb", "events": ["question.answered"]},
        {"url": "https://exa%41mple.com/x", "events": ["question.answered"]},
        {"url": "https://example..com/x", "events": ["question.answered"]},
        {"url": "https://" + "a" * 64 + ".com/x", "events": ["question.answered"]},
        {"url": "https://example.com:0/x", "events": ["question.answered"]},
    ],
)
async def test_registration_refuses_bad_and_private_urls_by_default(
    api_with: Callable[..., Awaitable[Api]], body: dict[str, Any]
) -> None:
    api = await api_with(outbound_allow_nets="")
    agent = await api.principal("deploybot", "agent")
    reply = await api.call("POST", "/v1/webhooks", agent, body)
    assert reply.status == 422, reply.body
    assert reply.headers["Content-Type"].startswith("application/problem+json")
    assert (await api.call("GET", "/v1/webhooks", agent)).body["webhooks"] == []


async def test_an_answer_is_delivered_once_signed_with_the_envelope_a_fetch_returns(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url, ["question.answered"])
    final = await answered_question(api, agent)
    delivery = await settled(api, agent, hook["id"], "delivered")
    assert len(receiver.hits) == 1
    sent = receiver.hits[0]
    payload = Verifier(hook["secret"]).verify(sent.body, sent.headers)
    assert payload["type"] == "question.answered"
    assert payload["data"] == final == (await api.get(agent, final["id"])).body
    assert sent.headers["webhook-id"] == delivery["id"]
    assert delivery["attempts"] == 1
    assert delivery["history"][0]["status"] == 200


async def test_only_subscribed_event_types_are_delivered(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    expired_only = await register(api, agent, receiver.url, ["question.expired"])
    created = await register(api, agent, receiver.url, ["question.created"])
    await answered_question(api, agent)
    await settled(api, agent, created["id"], "delivered")
    assert [Verifier(created["secret"]).verify(r.body, r.headers)["type"] for r in receiver.hits] == [
        "question.created"
    ]
    assert await deliveries(api, agent, expired_only["id"]) == []


async def test_a_failing_receiver_gets_retries_with_the_same_webhook_id_until_it_succeeds(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    async def fail_twice(n: int) -> web.Response:
        return web.Response(status=500 if n <= 2 else 204)

    receiver.reply = fail_twice
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    await answered_question(api, agent)
    delivery = await settled(api, agent, hook["id"], "delivered")
    assert len({r.headers["webhook-id"] for r in receiver.hits}) == 1
    assert len(receiver.hits) == 3
    assert [a["status"] for a in delivery["history"]] == [500, 500, 204]
    assert delivery["history"][0]["error"] == "HTTP 500"


async def test_a_receiver_that_answers_too_late_is_retried(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    async def slow_first(n: int) -> web.Response:
        if n == 1:
            await asyncio.sleep(2)
        return web.Response(status=200)

    receiver.reply = slow_first
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    await answered_question(api, agent)
    delivery = await settled(api, agent, hook["id"], "delivered")
    assert delivery["attempts"] == 2
    assert delivery["history"][0]["status"] is None
    assert "no response within" in delivery["history"][0]["error"]


async def test_redirects_are_not_followed(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    async def redirect(n: int) -> web.Response:
        return web.Response(status=302, headers={"Location": receiver.url.replace("/hook", "/elsewhere")})

    receiver.reply = redirect
    api = await api_with(webhook_retry_schedule="")
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    await answered_question(api, agent)
    delivery = await settled(api, agent, hook["id"], "dead")
    assert delivery["history"][0]["status"] == 302
    assert len(receiver.hits) == 1  # the redirect's target was never asked


async def test_after_the_last_attempt_a_delivery_is_dead_lettered_and_an_admin_can_replay_it(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    healthy = False

    async def down_until_healthy(n: int) -> web.Response:
        return web.Response(status=200 if healthy else 503)

    receiver.reply = down_until_healthy
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    await answered_question(api, agent)
    dead = await settled(api, agent, hook["id"], "dead")
    assert dead["attempts"] == 3
    assert len(receiver.hits) == 3
    assert (await api.call("GET", "/v1/admin/deadletters", agent)).status == 403
    metrics = (await api.call("GET", "/metrics")).body.decode()
    assert "qs_dead_letters 1.0" in metrics
    assert 'qs_delivery_attempts_total{outcome="dead",target="webhook"} 1.0' in metrics
    assert 'qs_delivery_attempts_total{outcome="retry",target="webhook"} 2.0' in metrics
    letters = (await api.call("GET", "/v1/admin/deadletters", api.admin)).body["deliveries"]
    assert [d["id"] for d in letters] == [dead["id"]]
    healthy = True
    replayed = await api.call("POST", f"/v1/admin/deadletters/{dead['id']}/replay", api.admin)
    assert replayed.status == 200
    assert replayed.body["delivery"]["status"] == "pending"
    delivered = await settled(api, agent, hook["id"], "delivered")
    assert delivered["id"] == dead["id"]
    assert receiver.hits[-1].headers["webhook-id"] == dead["id"]
    assert (await api.call("GET", "/v1/admin/deadletters", api.admin)).body["deliveries"] == []
    again = await api.call("POST", f"/v1/admin/deadletters/{dead['id']}/replay", api.admin)
    assert again.status == 404


async def test_a_dead_letter_leaves_the_stream_and_the_gauge_when_its_record_expires(
    api_with: Callable[..., Awaitable[Api]], redis_server: RedisServer, receiver: RecordingReceiver
) -> None:
    """After the retention the dead record is gone (not listed, not replayable); its stream entry
    must go too, or qs_dead_letters counts letters nobody can see."""

    async def down(n: int) -> web.Response:
        return web.Response(status=503)

    receiver.reply = down
    api = await api_with(webhook_retry_schedule="", retention_seconds=1)
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    await answered_question(api, agent)
    dead = await settled(api, agent, hook["id"], "dead")
    assert "qs_dead_letters 1.0" in (await api.call("GET", "/metrics")).body.decode()

    async def gone() -> bool:
        metrics = (await api.call("GET", "/metrics")).body.decode()
        return "qs_dead_letters 0.0" in metrics

    await eventually(gone, within=15, what="the expired dead letter to leave the gauge")
    app = api.client.app
    streams = [app[DELIVERY_WORKERS].store.keys.dead_letters(b) for b in range(BUCKETS)]  # type: ignore[index]
    assert [await app[REDIS].xlen(s) for s in streams] == [0] * BUCKETS  # type: ignore[index]
    assert (await api.call("GET", "/v1/admin/deadletters", api.admin)).body["deliveries"] == []
    replay = await api.call("POST", f"/v1/admin/deadletters/{dead['id']}/replay", api.admin)
    assert replay.status == 404


async def test_the_sender_refuses_private_addresses_unless_allow_listed(
    api_with: Callable[..., Awaitable[Api]], redis_server: RedisServer, receiver: RecordingReceiver
) -> None:
    """Registered where loopback was allowed, sent by a process where it is not: refused at send
    time (the check is on the address connected to), and the receiver never sees a request."""
    permissive = test_settings(redis_server.url, **{**FAST, "run_delivery": False})
    api = await api_with(permissive)
    await api_with(permissive.replace(run_delivery=True, outbound_allow_nets="", webhook_retry_schedule=""))
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    await answered_question(api, agent)
    dead = await settled(api, agent, hook["id"], "dead")
    assert dead["history"][0]["error"].startswith("refused")
    assert receiver.hits == []


async def test_the_sender_refuses_a_loopback_address_spelled_in_full_width_digits(
    receiver: RecordingReceiver,
) -> None:
    """aiohttp skips the resolver for a literal address, so post() checks it, as IDNA reads it."""
    url = receiver.url.replace("127.0.0.1", "\uff11\uff12\uff17.0.0.1")
    async with new_session(OutboundPolicy()) as session:
        attempt = await post(session, OutboundPolicy(), url, b"{}", {}, timeout=5)
    assert attempt.status == 0
    assert attempt.error == "refused: 127.0.0.1 is not an allowed address"
    assert receiver.hits == []


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", True),
        ("10.0.0.1", True),
        ("172.16.5.4", True),
        ("192.168.1.1", True),
        ("169.254.169.254", True),
        ("100.64.0.1", True),
        ("0.0.0.0", True),
        ("::1", True),
        ("fe80::1", True),
        ("fd00:ec2::254", True),
        ("::ffff:127.0.0.1", True),
        ("224.0.0.1", True),
        ("::7f00:1", True),  # IPv4-compatible 127.0.0.1: reserved, yet global to Python 3.11
        ("::ffff:0:7f00:1", True),  # IPv4-translated 127.0.0.1
        ("fec0::1", True),  # site-local
        ("8.8.8.8", False),
        ("2001:4860:4860::8888", False),
    ],
)
def test_outbound_policy_refuses_every_non_public_address(address: str, refused: bool) -> None:
    assert OutboundPolicy().refuses(ipaddress.ip_address(address)) is refused


@pytest.mark.parametrize(
    "host",
    [
        "example.com",
        "1e100.net",
        "8.8.8.8",
        "[2001:4860:4860::8888]",
        "x.0x7f",
        "bücher.example",
        "a_b.example.",
    ],
)
def test_public_names_and_dotted_quads_pass_the_url_check(host: str) -> None:
    assert OutboundPolicy().check_url(f"https://{host}/hook") == f"https://{host}/hook"


@pytest.mark.parametrize(
    "character",
    [" ", "\t", "\x7f", "\x85", "\x9b", "\xa0", "\u2028", "\u3000", "\u200b", "\ufeff"],
    ids=["space", "tab", "del", "nel", "csi", "nbsp", "line-separator", "ideographic-space",
         "zero-width-space", "bom"],
)  # fmt: skip
def test_a_url_with_any_space_or_control_character_is_refused(character: str) -> None:
    """What is checked must be what is sent: yarl percent-encodes these on the way out."""
    with pytest.raises(Invalid, match="spaces or control characters"):
        OutboundPolicy().check_url(f"https://example.com/ho{character}ok")


def test_the_allow_list_opens_exactly_its_networks() -> None:
    policy = OutboundPolicy(parse_nets("127.0.0.0/8, 10.1.0.0/16"))
    assert not policy.refuses(ipaddress.ip_address("127.0.0.1"))
    assert not policy.refuses(ipaddress.ip_address("10.1.200.3"))
    assert policy.refuses(ipaddress.ip_address("10.2.0.1"))


async def test_a_name_resolving_to_loopback_is_refused_by_the_resolver() -> None:
    resolver = GuardedResolver(OutboundPolicy())
    try:
        with pytest.raises(AddressRefused):
            await resolver.resolve("localhost", 80)
    finally:
        await resolver.close()


async def test_parallel_registrations_stop_at_the_per_owner_cap_of_25(
    api_with: Callable[..., Awaitable[Api]],
) -> None:
    """The count and the write are one script: 100 registrations at once leave exactly 25."""
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    body = {"url": "http://127.0.0.1:9/hook", "events": ["question.answered"]}
    replies = await asyncio.gather(*(api.call("POST", "/v1/webhooks", agent, body) for _ in range(100)))
    assert collections.Counter(r.status for r in replies) == {201: 25, 409: 75}
    refused = next(r for r in replies if r.status == 409)
    assert refused.body["type"].endswith("/conflict")
    listed = (await api.call("GET", "/v1/webhooks", agent)).body["webhooks"]
    assert sorted(h["id"] for h in listed) == sorted(r.body["id"] for r in replies if r.status == 201)
    assert all(h["created_ms"] > 0 for h in listed)


async def test_a_rotate_racing_a_delete_leaves_no_partial_endpoint_behind(
    api_with: Callable[..., Awaitable[Api]], redis_server: RedisServer
) -> None:
    """A rotate that read the endpoint before a delete removed it must not write the new secret
    into a fresh hash: that stub (a secret, no owner) made every later read of the id a 500."""
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    redis = api.client.app[REDIS]  # type: ignore[index]
    keys = api.client.app[DELIVERY_WORKERS].store.keys  # type: ignore[index]
    for _ in range(10):
        hook = await register(api, agent, "http://127.0.0.1:9/hook")
        path = f"/v1/webhooks/{hook['id']}"
        deleted, rotated = await asyncio.gather(
            api.call("DELETE", path, agent), api.call("POST", f"{path}/rotate", agent)
        )
        assert deleted.status == 204
        assert rotated.status in (200, 404), rotated.body
        assert await redis.exists(keys.webhook(hook["id"])) == 0
        assert (await api.call("POST", f"{path}/rotate", agent)).status == 404
        assert (await api.call("GET", f"{path}/deliveries", agent)).status == 404


async def post_to_loopback(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], *, timeout: float
) -> Attempt:
    """One post() to `handler`, served on a loopback port the policy allows."""
    app = web.Application()
    app.router.add_post("/hook", handler)
    async with on_loopback(app) as base, aiohttp.ClientSession() as session:
        loopback = OutboundPolicy(parse_nets("127.0.0.0/8"))
        return await post(session, loopback, f"{base}/hook", b"{}", {}, timeout)


async def test_a_receiver_whose_reply_body_never_ends_gets_its_status_recorded_not_read_whole() -> None:
    """The reply body is not used; reading all of it let a receiver fill the process's memory
    (a 1.5 GB body took it to 3 GiB). An endless body must not hold the attempt to its timeout."""
    chunk = b"x" * 65_536

    async def endless(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse()
        await reply.prepare(request)
        with contextlib.suppress(ConnectionResetError):  # the sender hanging up ends it
            while True:
                await reply.write(chunk)
        return reply

    attempt = await post_to_loopback(endless, timeout=30)
    assert (attempt.status, attempt.error) == (200, "")


async def test_a_slow_receiver_does_not_hold_up_deliveries_to_others(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    """The sender waited for every send of a pass before claiming again: one receiver taking
    its time (within the timeout) delayed every other webhook and Ping of the process."""
    release = asyncio.Event()

    async def reply(n: int) -> web.Response:
        if receiver.hits[n - 1].path == "/slow":
            await asyncio.wait_for(release.wait(), 20)
        return web.Response(status=200)

    receiver.reply = reply
    api = await api_with(webhook_timeout_seconds=10, delivery_lease_seconds=30)
    slow, fast = await api.principal("slowbot", "agent"), await api.principal("fastbot", "agent")
    await api.principal("alice", "user")
    await register(api, slow, f"{receiver.base}/slow", ["question.created"])
    await register(api, fast, f"{receiver.base}/fast", ["question.created"])

    def hit(path: str) -> Callable[[], Awaitable[bool]]:
        async def arrived() -> bool:
            return any(h.path == path for h in receiver.hits)

        return arrived

    try:
        await api.ask(slow, {"user": "alice"})
        await eventually(hit("/slow"), within=5, what="the slow receiver's request")
        await api.ask(fast, {"user": "alice"})
        # While the slow receiver still holds its request (a liveness bound, not a speed claim):
        await eventually(hit("/fast"), within=5, what="the other receiver's request")
        assert not release.is_set()
    finally:
        release.set()


async def test_a_2xx_whose_body_stalls_is_recorded_as_delivered_not_resent() -> None:
    """The status decides; the body is read only so the connection can be reused. A body that
    stalled past the timeout turned a delivered 200 into "no response" and a resend."""

    async def stalls(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse()
        reply.content_length = 1000
        await reply.prepare(request)
        await reply.write(b"x" * 10)
        await asyncio.sleep(3)  # past the sender's 1 s; then the server can shut down
        return reply

    attempt = await post_to_loopback(stalls, timeout=1)
    assert (attempt.status, attempt.error) == (200, "")


async def test_a_sender_killed_between_send_and_record_leaves_the_delivery_to_another(
    api_with: Callable[..., Awaitable[Api]], redis_server: RedisServer, receiver: RecordingReceiver
) -> None:
    """kill -9 of a worker while its POST is in flight: after the lease, another worker sends the
    same delivery again (same webhook-id) and records it; nothing is lost."""
    release = asyncio.Event()

    async def hold_first(n: int) -> web.Response:
        if n == 1:
            await release.wait()
        return web.Response(status=200)

    receiver.reply = hold_first
    settings = test_settings(redis_server.url, **{**FAST, "run_delivery": False})
    api = await api_with(settings)
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    env = {
        **os.environ,
        "QS_REDIS_URL": redis_server.url,
        "QS_KEY_PREFIX": settings.key_prefix,
        "QS_OUTBOUND_ALLOW_NETS": "127.0.0.0/8",
        "QS_DELIVERY_LEASE_SECONDS": "2",
        "QS_WEBHOOK_TIMEOUT_SECONDS": "1",
        "QS_KEYSPACE_NOTIFICATIONS": "false",
    }
    first = await asyncio.create_subprocess_exec(sys.executable, "-m", "service", "worker", env=env)
    second: asyncio.subprocess.Process | None = None
    try:
        await answered_question(api, agent)
        await receiver.at(None, 1)
        first.send_signal(signal.SIGKILL)
        await asyncio.wait_for(first.wait(), 10)
        release.set()
        assert (await deliveries(api, agent, hook["id"]))[0]["status"] == "pending"
        second = await asyncio.create_subprocess_exec(sys.executable, "-m", "service", "worker", env=env)
        delivery = await settled(api, agent, hook["id"], "delivered", within=30)
    finally:
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 10)
    assert len(receiver.hits) == 2
    assert {r.headers["webhook-id"] for r in receiver.hits} == {delivery["id"]}
    assert delivery["attempts"] == 1  # the killed worker never recorded its attempt


def ask_with_own_webhook(url: str) -> dict[str, Any]:
    """A question to alice that carries its own webhook_url."""
    return {
        "prompt": "Proceed?",
        "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
        "to": {"user": "alice"},
        "expires_in": 60,
        "webhook_url": url,
    }


async def test_every_delivery_index_expires_after_the_retention_like_the_records_it_names(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver, redis: Redis
) -> None:
    """One index per question with a webhook_url, and one per endpoint even once deleted: they
    had no expiry and piled up for good."""
    api = await api_with(retention_seconds=600)
    agent = await api.principal("deploybot", "agent")
    user = await api.principal("alice", "user")
    await register(api, agent, receiver.url)
    body = ask_with_own_webhook(receiver.url)
    created = await api.call("POST", "/v1/questions", agent, body)
    assert (await api.answer(user, created.body["id"], "no")).body["applied"] is True
    await receiver.at(None, 2)
    prefix = api.client.app[SETTINGS].key_prefix  # type: ignore[index]
    indexes = [key async for key in redis.scan_iter(match=f"{prefix}:*:webhook:*:deliveries")]
    assert len(indexes) == 2  # the endpoint's, and the question's own URL's
    for index in indexes:
        assert 0 < await redis.pttl(index) <= 600_000, index


async def test_a_questions_own_webhook_url_gets_its_terminal_event_signed_with_its_secret(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    user = await api.principal("alice", "user")
    body = ask_with_own_webhook(receiver.url)
    created = await api.call("POST", "/v1/questions", agent, body, headers={"Idempotency-Key": "k1"})
    assert created.status == 201
    secret = created.headers["Webhook-Secret"]
    assert secret.startswith("whsec_")
    assert "webhook_url" not in created.body
    assert "hook_secret" not in json.dumps(created.body)
    replayed = await api.call("POST", "/v1/questions", agent, body, headers={"Idempotency-Key": "k1"})
    assert replayed.status == 200
    assert replayed.headers["Webhook-Secret"] == secret
    final = (await api.answer(user, created.body["id"], "no")).body["question"]
    await receiver.at(None, 1)
    payload = Verifier(secret).verify(receiver.hits[0].body, receiver.hits[0].headers)
    assert payload["type"] == "question.answered"
    assert payload["data"] == final
    private = {**body, "webhook_url": "http://192.168.0.10/hook"}
    refused = await api.call("POST", "/v1/questions", agent, private)
    assert refused.status == 422


async def test_deliveries_go_on_after_script_flush(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver, redis_server: RedisServer
) -> None:
    """NOSCRIPT: the fan-out and the sender load their scripts again by themselves."""
    api = await api_with()
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url)
    redis = api.client.server.app[REDIS]
    await redis.script_flush()
    await answered_question(api, agent)
    delivery = await settled(api, agent, hook["id"], "delivered")
    assert delivery["attempts"] == 1


async def test_a_sender_claims_no_more_than_it_can_send_before_their_leases_run_out(
    api_with: Callable[..., Awaitable[Api]], redis_server: RedisServer, receiver: RecordingReceiver
) -> None:
    """A claimed delivery must be sent and recorded within its lease, or another sender sends it
    too. With 32 sends at once, 1 s per attempt at worst and a 3 s lease, one pass may take 64
    (two rounds, leaving one round for the records); the rest stay due for any sender."""
    settings = test_settings(
        redis_server.url,
        **{**FAST, "run_delivery": False, "webhook_timeout_seconds": 1.0, "delivery_lease_seconds": 3.0},
    )
    api = await api_with(settings)
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url, ["question.created"])
    workers = api.client.app[DELIVERY_WORKERS]  # type: ignore[index]
    for n in range(100):
        event = {"id": new_question_id(n % BUCKETS), "type": "question.created"}
        record = (hook["id"], receiver.url, "{}", f"msg_{n:032x}")
        assert await workers.store.enqueue_many(event, [record]) == [True]

    sent = await workers.sender.send_due()

    assert sent == 64
    assert len(receiver.hits) == 64
    redis = api.client.app[REDIS]  # type: ignore[index]
    now_ms = int(time.time() * 1000) + 1000  # a margin for the clocks: nothing sent is due again
    still_due = [
        len(await redis.zrange(workers.store.keys.deliveries_due(b), "-inf", now_ms, byscore=True))
        for b in range(BUCKETS)
    ]
    assert sum(still_due) == 36


async def test_a_pass_whose_sends_fail_waits_for_all_of_them_and_reports_every_failure(
    api_with: Callable[..., Awaitable[Api]],
    redis_server: RedisServer,
    receiver: RecordingReceiver,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis fails under the records of three sends: the pass ends after all three, raising one
    failure and logging the others, instead of raising at the first while the rest run on
    unwatched and their failures vanish."""
    settings = test_settings(redis_server.url, **{**FAST, "run_delivery": False})
    api = await api_with(settings)
    agent = await api.principal("deploybot", "agent")
    hook = await register(api, agent, receiver.url, ["question.created"])
    workers = api.client.app[DELIVERY_WORKERS]  # type: ignore[index]
    for n in range(3):
        event = {"id": new_question_id(n), "type": "question.created"}
        record = (hook["id"], receiver.url, "{}", f"msg_{n:032x}")
        assert await workers.store.enqueue_many(event, [record]) == [True]
    started: list[str] = []
    settled: list[str] = []

    async def failing_settle(delivery: Any, *_args: Any) -> None:
        started.append(delivery.id)
        await asyncio.sleep(0.05 * len(started))  # each record fails a little later
        settled.append(delivery.id)
        raise RedisConnectionError(f"lost under {delivery.id}")

    monkeypatch.setattr(workers.store, "settle", failing_settle)
    with pytest.raises(RedisConnectionError, match="lost under"):
        await workers.sender.send_due()
    assert len(settled) == 3
    assert caplog.text.count("failed too") == 2


async def fanned_out_by_hand(
    api_with: Callable[..., Awaitable[Api]], redis_url: str, receiver: RecordingReceiver
) -> tuple[Api, str, dict[str, Any]]:
    """A service whose fan-out the test drives itself (its groups made, no sender running), an
    agent with a question.created webhook, and alice to ask: (api, agent token, webhook)."""
    api = await api_with(test_settings(redis_url, **{**FAST, "run_delivery": False}))
    agent = await api.principal("deploybot", "agent")
    await api.principal("alice", "user")
    hook = await register(api, agent, receiver.url, ["question.created"])
    await api.client.server.app[DELIVERY_WORKERS].fanout.ensure_groups()
    return api, agent, hook


async def test_events_of_two_buckets_under_the_same_entry_id_are_two_deliveries_with_two_ids(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver, redis_server: RedisServer
) -> None:
    """Entry ids are unique within one bucket's outbox only: two buckets appending in the same
    millisecond get the same id. Their events were one webhook-id (receivers dropped the second
    as a duplicate) and the same delivery key name in two buckets."""
    api, agent, hook = await fanned_out_by_hand(api_with, redis_server.url, receiver)
    fanout = api.client.server.app[DELIVERY_WORKERS].fanout
    redis = api.client.server.app[REDIS]
    by_bucket: dict[int, str] = {}
    while len(by_bucket) < 2:
        question = await api.ask(agent, {"user": "alice"})
        by_bucket.setdefault(bucket_of(question["id"]), question["id"])
    outboxes = {fanout.keys.outbox(b): "0" for b in by_bucket}
    read = await redis.xread(outboxes)
    same_id = "1700000000000-0"
    await fanout.process([(outbox, [(same_id, entries[0][1])]) for outbox, entries in read])

    made = await deliveries(api, agent, hook["id"])
    assert sorted(d["question_id"] for d in made) == sorted(by_bucket.values())
    assert len({d["id"] for d in made}) == 2


async def test_a_fan_out_refused_by_a_full_redis_is_retried_later_not_skipped(
    api_with: Callable[..., Awaitable[Api]], receiver: RecordingReceiver
) -> None:
    own = RedisServer().start()  # made to refuse writes: not the session's server
    try:
        api, agent, hook = await fanned_out_by_hand(api_with, own.url, receiver)
        fanout = api.client.server.app[DELIVERY_WORKERS].fanout
        redis = api.client.server.app[REDIS]
        await api.ask(agent, {"user": "alice"})
        outboxes = {fanout.keys.outbox(b): ">" for b in range(BUCKETS)}
        read = await redis.xreadgroup(fanout.group, fanout.consumer, outboxes, count=10)

        await redis.config_set("maxmemory", "1")
        with pytest.raises(Unavailable):
            await fanout.consume(read)
        assert fanout.skipped == 0
        assert (await redis.xpending(read[0][0], fanout.group))["pending"] == 1

        await redis.config_set("maxmemory", "0")
        await fanout.consume(read)
        assert (await redis.xpending(read[0][0], fanout.group))["pending"] == 0
        assert len(await deliveries(api, agent, hook["id"])) == 1
    finally:
        own.cleanup()
