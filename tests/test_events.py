"""GET /v1/events: per-principal Server-Sent Events, relayed from the outbox, resumable."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service import outbox as outbox_module
from service.events import GROUP, EventHub, EventRelay
from service.http.appkeys import EVENT_HUB
from service.keys import Keys
from service.outbox import RUN_ALL_BATCH
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client, test_settings
from tests.redis_server import RedisServer


@asynccontextmanager
async def stream(api: Api, token: str, last_event_id: str | None = None) -> AsyncIterator[ClientResponse]:
    headers = {"Authorization": f"Bearer {token}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    async with api.client.get("/v1/events", headers=headers) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        yield response


async def next_event(response: ClientResponse, timeout: float = 5) -> dict[str, Any]:
    """The next event (id, event, data), skipping comments and the retry hint."""
    event: dict[str, Any] = {}
    async with asyncio.timeout(timeout):
        while True:
            line = (await response.content.readline()).decode().rstrip("\n")
            if line == "":
                if "event" in event:
                    return event
                event = {}
                continue
            name, _, value = line.partition(": ")
            if name == "data":
                event["data"] = json.loads(value)
            elif name in ("id", "event"):
                event[name] = value


async def people(api: Api) -> tuple[str, str, str]:
    agent = await api.principal("bot", "agent")
    alice = await api.principal("alice", "user")
    bob = await api.principal("bob", "user")
    return agent, alice, bob


async def test_target_sees_created_then_resolved_with_the_fetched_envelope(api: Api) -> None:
    agent, alice, _ = await people(api)
    async with stream(api, alice) as events:
        await asyncio.sleep(0.1)
        question = await api.ask(agent, {"user": "alice"})
        created = await next_event(events)
        assert created["event"] == "question.created"
        assert created["data"]["id"] == question["id"]
        await api.answer(alice, question["id"], "yes")
        resolved = await next_event(events)
    assert resolved["event"] == "question.resolved"
    assert resolved["data"] == (await api.get(agent, question["id"])).body


async def test_asker_sees_resolved_but_not_created(api: Api) -> None:
    agent, _, _ = await people(api)
    async with stream(api, agent) as events:
        await asyncio.sleep(0.1)
        question = await api.ask(agent, {"user": "alice"})
        await api.cancel(agent, question["id"], "changed my mind")
        resolved = await next_event(events)
    assert resolved["event"] == "question.resolved"
    assert resolved["data"]["state"] == "cancelled"
    assert resolved["data"]["cancellation"] == {"by": "bot", "reason": "changed my mind"}


async def test_every_room_member_hears_of_a_room_question(api: Api) -> None:
    agent, alice, bob = await people(api)
    await api.room("ops", ["alice", "bob"])
    async with stream(api, alice) as a_events, stream(api, bob) as b_events:
        await asyncio.sleep(0.1)
        question = await api.ask(agent, {"room": "ops"})
        for events in (a_events, b_events):
            got = await next_event(events)
            assert (got["event"], got["data"]["id"]) == ("question.created", question["id"])


async def test_resume_with_last_event_id_loses_and_repeats_nothing(api: Api) -> None:
    agent, alice, _ = await people(api)
    async with stream(api, alice) as events:
        await asyncio.sleep(0.1)
        first = await api.ask(agent, {"user": "alice"})
        seen = await next_event(events)
        assert seen["data"]["id"] == first["id"]
    missed = [(await api.ask(agent, {"user": "alice"}))["id"] for _ in range(5)]
    await api.answer(alice, missed[0], "no")
    async with stream(api, alice, last_event_id=seen["id"]) as events:
        replayed = [await next_event(events) for _ in range(6)]
    kinds = [(e["event"], e["data"]["id"]) for e in replayed]
    assert kinds == [
        *[("question.created", q) for q in missed],
        ("question.resolved", missed[0]),
    ]
    ids = [e["id"] for e in replayed]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert seen["id"] not in ids


async def test_a_last_event_id_beyond_the_newest_event_resumes_from_the_newest(api: Api) -> None:
    """An id the stream never reached (a Redis that lost data since) silenced the stream until
    Redis' clock passed it."""
    agent, alice, _ = await people(api)
    async with stream(api, alice, last_event_id="99999999999999-0") as events:
        await asyncio.sleep(0.1)
        asked = await api.ask(agent, {"user": "alice"})
        seen = await next_event(events)
    assert (seen["event"], seen["data"]["id"]) == ("question.created", asked["id"])


async def test_head_of_the_event_stream_is_its_headers_alone_and_holds_no_stream(api: Api) -> None:
    """A body after a HEAD's headers is read as the next response on a kept-alive connection;
    and an open HEAD held one of the principal's stream slots."""
    _, alice, _ = await people(api)
    server = api.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    request = f"HEAD /v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {alice}\r\n"
    try:
        writer.write(request.encode() + b"Connection: close\r\n\r\n")
        async with asyncio.timeout(5):  # a stream would never end
            reply = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in head
    assert body == b""
    assert api.client.app[EVENT_HUB].streams_of("alice") == 0


async def test_a_bad_last_event_id_is_refused(api: Api) -> None:
    _, alice, _ = await people(api)
    reply = await api.call("GET", "/v1/events", alice, headers={"Last-Event-ID": "yesterday"})
    assert reply.status == 422


async def test_idle_stream_sends_heartbeat_comments(redis_server: RedisServer) -> None:
    client: TestClient[object, object] = await start_client(
        test_settings(redis_server.url, sse_heartbeat_seconds=0.2)
    )
    try:
        api = Api(client, ADMIN_TOKEN)
        _, alice, _ = await people(api)
        async with stream(api, alice) as events:
            lines = [(await events.content.readline()).decode() for _ in range(4)]
        assert ": keep-alive\n" in lines
    finally:
        await client.close()


async def test_a_stream_ends_when_its_token_is_revoked_and_sends_nothing_after(api: Api) -> None:
    agent, _, _ = await people(api)
    issued = await api.call("POST", "/v1/admin/principals/alice/tokens", api.admin)
    token, token_id = issued.body["token"], issued.body["token_id"]
    async with stream(api, token) as events:
        await asyncio.sleep(0.1)
        assert (await api.call("DELETE", f"/v1/admin/tokens/{token_id}", api.admin)).status == 204
        await api.ask(agent, {"user": "alice"}, prompt="after the revoke")
        async with asyncio.timeout(10):
            rest = await events.content.read()  # to the end of the stream
    assert b"after the revoke" not in rest
    assert b"question.created" not in rest
    assert (await api.call("GET", "/v1/events", token)).status == 401


@dataclass
class NoRelay:
    """The app with its own event relay off: the test plays the relays."""

    api: Api
    keys: Keys
    redis: Redis
    agent: str
    alice: str

    def relay(self) -> EventRelay:
        return EventRelay(self.redis, self.keys, maxlen=1000, ttl_seconds=60)

    async def ask_and_take(self, relay: EventRelay) -> tuple[str, str, list[Any]]:
        """A question for alice, and its outbox entry read by `relay` (not yet relayed)."""
        await relay.ensure_groups()
        question = await self.api.ask(self.agent, {"user": "alice"})
        outbox = self.keys.outbox(int(question["id"][0], 16))
        taken = await self.redis.xreadgroup(GROUP, relay.consumer, {outbox: ">"}, count=10)
        assert len(taken[0][1]) == 1
        return question["id"], outbox, taken[0][1]


@pytest.fixture
async def no_relay(redis_server: RedisServer, redis: Redis) -> AsyncIterator[NoRelay]:
    settings = test_settings(redis_server.url, run_event_relay=False)
    client: TestClient[object, object] = await start_client(settings)
    try:
        api = Api(client, ADMIN_TOKEN)
        agent, alice, _ = await people(api)
        yield NoRelay(api, Keys(settings.key_prefix), redis, agent, alice)
    finally:
        await client.close()


async def test_events_a_dead_relay_left_unacknowledged_are_reclaimed(no_relay: NoRelay) -> None:
    redis, keys = no_relay.redis, no_relay.keys
    question_id, outbox, _ = await no_relay.ask_and_take(no_relay.relay())
    # The relay that read it "dies" without relaying or acking.
    assert await redis.xlen(keys.events("alice")) == 0

    survivor = no_relay.relay()
    survivor.reclaim_idle_ms = 1
    await asyncio.sleep(0.01)
    await survivor.reclaim()
    async with stream(no_relay.api, no_relay.alice, last_event_id="0-0") as events:
        got = await next_event(events)
    assert (got["event"], got["data"]["id"]) == ("question.created", question_id)
    assert (await redis.xpending(outbox, GROUP))["pending"] == 0


async def test_an_event_whose_append_failed_stays_unacknowledged_for_a_retry(no_relay: NoRelay) -> None:
    redis, keys = no_relay.redis, no_relay.keys
    await redis.set(keys.events("alice"), "not a stream")  # every XADD to it fails: WRONGTYPE
    relay = no_relay.relay()
    _, outbox, entries = await no_relay.ask_and_take(relay)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await relay.consume([(outbox, entries)])
    assert (await redis.xpending(outbox, GROUP))["pending"] == 1

    await redis.delete(keys.events("alice"))
    await relay.consume([(outbox, entries)])
    assert (await redis.xpending(outbox, GROUP))["pending"] == 0
    assert await redis.xlen(keys.events("alice")) == 1


async def test_one_read_across_outboxes_is_relayed_and_acknowledged_in_every_outbox(
    no_relay: NoRelay,
) -> None:
    redis, keys = no_relay.redis, no_relay.keys
    relay = no_relay.relay()
    taken: dict[str, list[Any]] = {}
    while len(taken) < 3:  # questions land in random buckets: ask until three outboxes hold one
        _, outbox, entries = await no_relay.ask_and_take(relay)
        taken.setdefault(outbox, []).extend(entries)
    read = list(taken.items())

    await relay.consume(read)

    relayed = sum(len(entries) for entries in taken.values())
    assert await redis.xlen(keys.events("alice")) == relayed
    for outbox in taken:
        assert (await redis.xpending(outbox, GROUP))["pending"] == 0


async def test_a_failed_append_leaves_the_whole_read_unacknowledged(no_relay: NoRelay) -> None:
    redis, keys = no_relay.redis, no_relay.keys
    relay = no_relay.relay()
    taken: dict[str, list[Any]] = {}
    while len(taken) < 2:
        _, outbox, entries = await no_relay.ask_and_take(relay)
        taken.setdefault(outbox, []).extend(entries)
    await redis.set(keys.events("alice"), "not a stream")  # every XADD to it fails: WRONGTYPE

    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await relay.consume(list(taken.items()))

    for outbox, entries in taken.items():
        assert (await redis.xpending(outbox, GROUP))["pending"] == len(entries)


async def test_an_entry_the_scripts_did_not_write_is_skipped_and_the_events_read_with_it_are_relayed(
    no_relay: NoRelay, caplog: pytest.LogCaptureFixture
) -> None:
    redis, keys, api = no_relay.redis, no_relay.keys, no_relay.api
    relay = no_relay.relay()
    await relay.ensure_groups()
    first = (await api.ask(no_relay.agent, {"user": "alice"}))["id"]
    hand_made = {"type": "question.created", "note": "hand-made"}
    foreign = await redis.xadd(keys.outbox(int(first[0], 16)), hand_made)
    second = (await api.ask(no_relay.agent, {"user": "alice"}))["id"]
    outboxes = {keys.outbox(b): ">" for b in range(16)}
    read = await redis.xreadgroup(GROUP, relay.consumer, outboxes, count=10)
    assert sum(len(entries) for _, entries in read) == 3

    await relay.consume(read)

    relayed = [json.loads(fields["data"])["id"] for _, fields in await redis.xrange(keys.events("alice"))]
    assert sorted(relayed) == sorted([first, second])
    assert relay.skipped == 1
    for b in range(16):
        assert (await redis.xpending(keys.outbox(b), GROUP))["pending"] == 0
    # (The app's webhook fan-out skips it too, in its own group and words.)
    skipped = [r for r in caplog.records if r.getMessage().startswith("event relay: skipped outbox entry")]
    assert len(skipped) == 1
    assert foreign in skipped[0].getMessage()
    assert skipped[0].exc_info is not None


async def test_a_poison_entry_after_a_big_rooms_event_appends_that_event_once_not_twice(
    no_relay: NoRelay,
) -> None:
    """The one-by-one pass after a failed read must not append again what the failed pass had
    already sent (a big room's event fills a round trip before the poison entry is reached)."""
    api, redis, keys = no_relay.api, no_relay.redis, no_relay.keys
    await api.room("crowd", ["alice"])
    await redis.sadd(keys.room_members("crowd"), *(f"m{i}" for i in range(1100)))  # 2,200 commands
    relay = no_relay.relay()
    await relay.ensure_groups()
    asked = (await api.ask(no_relay.agent, {"room": "crowd"}))["id"]
    outbox = keys.outbox(int(asked[0], 16))
    await redis.xadd(outbox, {"type": "question.created", "question": "not JSON"})
    read = await redis.xreadgroup(GROUP, relay.consumer, {outbox: ">"}, count=10)
    assert len(read[0][1]) == 2

    await relay.consume(read)

    assert relay.skipped == 1
    for member in ("m0", "m1099", "alice"):
        assert await redis.xlen(keys.events(member)) == 1


async def test_a_failover_error_during_a_read_acknowledges_nothing_and_skips_nothing(
    no_relay: NoRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py raises AttributeError when a failover drops a connection under a call: an outage,
    not a poison entry, so the read must come back whole rather than be skipped."""
    relay = no_relay.relay()
    _, outbox, entries = await no_relay.ask_and_take(relay)

    async def failover(redis: Redis, commands: Any, **kwargs: Any) -> Any:
        raise AttributeError("'NoneType' object has no attribute 'write'")

    monkeypatch.setattr(outbox_module, "exchange", failover)
    with pytest.raises(AttributeError):
        await relay.consume([(outbox, entries)])
    monkeypatch.undo()

    assert relay.skipped == 0
    assert (await no_relay.redis.xpending(outbox, GROUP))["pending"] == 1


async def until_blocked_in_xread(redis: Redis, client_name: str) -> None:
    async with asyncio.timeout(5):
        while True:
            clients = await redis.client_list()
            if any(c.get("name") == client_name and c.get("cmd") == "xread" for c in clients):
                return
            await asyncio.sleep(0.01)


async def drain(subscriber: Any, count: int) -> list[str]:
    async with asyncio.timeout(5):
        return [(await subscriber.queue.get()).id for _ in range(count)]


async def test_a_resume_joining_during_a_live_read_still_gets_its_whole_backlog(
    redis_server: RedisServer, redis: Redis
) -> None:
    """A second tab (or a reconnect while the old connection is held) resumes from an older id
    while the hub is blocked reading for the first: it must get the backlog, not only new events."""
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    stream_key = keys.events("alice")
    backlog = [await redis.xadd(stream_key, {"type": "question.created", "data": "{}"}) for _ in range(3)]
    name = f"hub-{uuid.uuid4().hex[:8]}"
    blocking = Redis.from_url(redis_server.url, decode_responses=True, client_name=name)
    hub = EventHub(redis, keys, block_ms=3000, blocking=blocking)
    await hub.start()
    try:
        live = hub.subscribe("alice", backlog[-1])
        await until_blocked_in_xread(redis, name)
        resumed = hub.subscribe("alice", "0-0")
        new = await redis.xadd(stream_key, {"type": "question.resolved", "data": "{}"})
        assert await drain(live, 1) == [new]
        assert await drain(resumed, 4) == [*backlog, new]
    finally:
        await hub.stop()
        await blocking.aclose()


async def test_a_stream_entry_that_is_not_an_event_is_passed_over_not_fatal(
    redis_server: RedisServer, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    stream_key = keys.events("alice")
    hub = EventHub(redis, keys, block_ms=100)
    await hub.start()
    try:
        subscriber = hub.subscribe("alice", "0-0")
        await redis.xadd(stream_key, {"written by": "an operator"})
        event = await redis.xadd(stream_key, {"type": "question.created", "data": "{}"})
        assert await drain(subscriber, 1) == [event]
        later = await redis.xadd(stream_key, {"type": "question.resolved", "data": "{}"})
        assert await drain(subscriber, 1) == [later]
    finally:
        await hub.stop()
    assert "is not an event" in caplog.text


async def test_events_for_a_big_room_are_appended_in_bounded_round_trips(
    no_relay: NoRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round trip of every append of a read (millions of commands for a big room) outlived the
    socket timeout, and each retry appended every event again."""
    api, redis, keys = no_relay.api, no_relay.redis, no_relay.keys
    members = [f"m{i}" for i in range(1500)]
    await api.room("crowd", ["alice"])
    await redis.sadd(keys.room_members("crowd"), *members)  # 1,500 principals made faster
    relay = no_relay.relay()
    await relay.ensure_groups()
    asked = [await api.ask(no_relay.agent, {"room": "crowd"}) for _ in range(2)]
    outboxes = {keys.outbox(int(q["id"][0], 16)) for q in asked}
    taken = await redis.xreadgroup(GROUP, relay.consumer, dict.fromkeys(outboxes, ">"), count=10)
    sizes: list[int] = []
    plain_exchange = outbox_module.exchange

    async def recorded(redis: Redis, commands: Any, **kwargs: Any) -> Any:
        sizes.append(len(commands))
        return await plain_exchange(redis, commands, **kwargs)

    monkeypatch.setattr(outbox_module, "exchange", recorded)
    await relay.consume([(outbox, entries) for outbox, entries in taken])

    assert sum(sizes) >= 2 * 2 * len(members)  # an XADD and an EXPIRE per recipient and event
    assert max(sizes) <= RUN_ALL_BATCH
    for member in ("m0", "m777", "m1499"):
        assert await redis.xlen(keys.events(member)) == 2


async def test_a_principal_beyond_its_open_stream_limit_gets_429_and_one_closing_frees_a_place(
    redis_server: RedisServer,
) -> None:
    client: TestClient[object, object] = await start_client(
        test_settings(redis_server.url, sse_streams_per_principal=2)
    )
    try:
        api = Api(client, ADMIN_TOKEN)
        _, alice, bob = await people(api)
        async with stream(api, alice), stream(api, alice) as second:
            refused = await api.call("GET", "/v1/events", alice)
            assert refused.status == 429
            assert refused.body["type"].endswith("/too-many-streams")
            async with stream(api, bob):  # the limit is per principal
                pass
            second.close()
            await asyncio.sleep(0.2)  # the server notices the closed connection
            async with stream(api, alice):
                pass
    finally:
        await client.close()
