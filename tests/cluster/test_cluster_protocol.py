"""The service on a real Redis Cluster (3 primaries, 3 replicas): the HTTP protocol, waiters,
keyspace expiry, the event relay and hub, NOSCRIPT recovery and WAIT, each across all primaries."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiohttp.test_utils import TestClient
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from service.coalesce import Coalescer
from service.http.appkeys import EVENT_HUB, LISTENER, REDIS, SCRIPTS, STORE, WAITERS
from service.keys import BUCKETS
from service.redis_client import as_cluster
from tests.api import Api
from tests.cluster.cluster_server import ClusterServer
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.helpers_reliability import eventually


async def setup_people(api: Api) -> dict[str, str]:
    tokens = {"agent": await api.principal("agent", "agent")}
    for user in ("alice", "bob"):
        tokens[user] = await api.principal(user, "user")
    await api.room("ops", ["alice", "bob"])
    return tokens


def owners(client: TestClient[object, object], question_ids: Sequence[str]) -> set[str]:
    """The primaries that hold these questions."""
    cluster = as_cluster(client.server.app[REDIS])
    store = client.server.app[STORE]
    nodes = set()
    for question_id in question_ids:
        node = cluster.get_node_from_key(store.keys.for_question(question_id).question)
        assert node is not None
        nodes.add(node.name)
    return nodes


async def ask_many(api: Api, token: str, count: int, **extra: Any) -> list[dict[str, Any]]:
    return [await api.ask(token, {"user": "alice"}, **extra) for _ in range(count)]


def record_script_calls(coalescer: Coalescer) -> list[Sequence[str]]:
    """Every script call's KEYS, as the coalescer receives them."""
    seen: list[Sequence[str]] = []
    original = coalescer.evalsha

    def evalsha(sha: str, source: str, keys: Sequence[str], args: Sequence[str | int], **kw: Any) -> Any:
        seen.append(list(keys))
        return original(sha, source, keys, args, **kw)

    coalescer.evalsha = evalsha  # type: ignore[method-assign]
    return seen


async def test_protocol_over_http_spans_every_primary_and_keeps_each_script_in_one_slot(
    cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    api = cluster_api
    calls = record_script_calls(cluster_client.server.app[SCRIPTS].coalescer)
    tokens = await setup_people(api)
    agent, alice, bob = tokens["agent"], tokens["alice"], tokens["bob"]

    asked = await ask_many(api, agent, 40)
    ids = [q["id"] for q in asked]
    assert len(owners(cluster_client, ids)) == 3, "40 questions should land on all three primaries"
    for question_id in ids:
        fetched = await api.get(alice, question_id)
        assert fetched.status == 200
        assert fetched.body["state"] == "pending"

    # A waiter wakes on an answer whatever primary holds the question.
    waiting = [asyncio.create_task(api.wait(agent, q, 10)) for q in ids[:8]]
    await wait_for_waiters(cluster_client, 8)
    for question_id in ids[:20]:
        reply = await api.answer(alice, question_id, "yes")
        assert (reply.status, reply.body["applied"]) == (200, True), reply.body
    for woken in await asyncio.gather(*waiting):
        assert woken.status == 200
        assert woken.body["state"] == "answered"
    again = await api.answer(alice, ids[0], "no")
    assert again.status == 200
    assert not again.body["applied"]
    assert again.body["question"]["answer"]["option"] == "yes"

    for question_id in ids[20:30]:
        reply = await api.cancel(agent, question_id, "not needed")
        assert reply.status == 200
        assert reply.body["question"]["state"] == "cancelled"
    room_question = await api.ask(agent, {"room": "ops"})
    assert (await api.answer(bob, room_question["id"], "no")).body["applied"]
    short = await api.ask(agent, {"user": "alice"}, expires_in=1)
    expired = await api.wait(agent, short["id"], 8)
    assert expired.body["state"] == "expired"

    # The asker's list merges all 16 bucket indexes (on three primaries), newest first.
    listed: list[str] = []
    cursor = None
    while True:
        query: dict[str, Any] = {"role": "asker", "limit": 7}
        if cursor:
            query["cursor"] = cursor
        page = await api.list(agent, **query)
        assert page.status == 200, page.body
        listed.extend(item["id"] for item in page.body["items"])
        cursor = page.body["next_cursor"]
        if cursor is None:
            break
    everything = [*ids, room_question["id"], short["id"]]
    assert sorted(listed) == sorted(everything)
    assert len(listed) == len(set(listed))
    created = {q["id"]: q["created_at"] for q in asked}
    in_order = [created[q] for q in listed if q in created]
    assert in_order == sorted(in_order, reverse=True)
    pending = await api.list(alice, role="responder", state="pending", limit=50)
    assert sorted(item["id"] for item in pending.body["items"]) == sorted(ids[30:])

    assert calls, "no script call was recorded"
    for keys in calls:
        slots = {key_slot(key.encode()) for key in keys}
        assert len(slots) == 1, f"a script call spans slots: {keys}"


async def wait_for_waiters(client: TestClient[object, object], count: int) -> None:
    waiters = client.server.app[WAITERS]

    async def parked() -> bool:
        return waiters.waiting >= count and waiters.confirming == 0

    await eventually(parked, within=10, what=f"{count} waiters parked on confirmed subscriptions")


async def test_many_waiters_on_every_primary_use_one_connection_per_primary_and_all_wake(
    cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    tokens = await setup_people(cluster_api)
    ids = [q["id"] for q in await ask_many(cluster_api, tokens["agent"], 30)]
    waits = [asyncio.create_task(cluster_api.wait(tokens["agent"], q, 15)) for q in ids for _ in range(3)]
    await wait_for_waiters(cluster_client, len(waits))
    waiters = cluster_client.server.app[WAITERS]
    assert waiters.channels == len(ids)
    sharded = waiters._sharded
    assert sharded is not None
    assert len(sharded.node_pubsub_mapping) == 3  # one connection per primary, not per waiter
    await asyncio.gather(*(cluster_api.answer(tokens["alice"], q, "yes") for q in ids))
    woken = await asyncio.gather(*waits)
    assert [w.body["state"] for w in woken] == ["answered"] * len(waits)
    assert {w.body["answer"]["option"] for w in woken} == {"yes"}


async def test_waiter_sunsubscribed_under_it_subscribes_again_and_is_still_woken(
    cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    """A SUNSUBSCRIBE under a parked waiter (a stray one of ours, or a slot that changed owner)
    leaves it unsubscribed: it must subscribe again and re-read, not wait out its timeout."""
    tokens = await setup_people(cluster_api)
    question_id = (await cluster_api.ask(tokens["agent"], {"user": "alice"}))["id"]
    waiting = asyncio.create_task(cluster_api.wait(tokens["agent"], question_id, 30))
    await wait_for_waiters(cluster_client, 1)
    waiters = cluster_client.server.app[WAITERS]
    sharded = waiters._sharded
    assert sharded is not None
    resubscribed = waiters.resubscriptions

    await sharded.sunsubscribe(cluster_client.server.app[STORE].channel(question_id))

    async def healed() -> bool:
        return waiters.resubscriptions > resubscribed

    await eventually(healed, within=10, what="the waiter subscribed again")
    answered = await cluster_api.answer(tokens["alice"], question_id, "yes")
    async with asyncio.timeout(10):  # woken, not timed out (the wait runs 30 s)
        woken = await waiting
    assert woken.body == answered.body["question"]


async def test_keyspace_listener_expires_questions_on_every_primary_without_the_sweeper(
    cluster_server: ClusterServer,
) -> None:
    settings = test_settings(cluster_server.url, run_sweeper=False)
    client = await start_client(settings)
    try:
        api = Api(client, ADMIN_TOKEN)
        tokens = await setup_people(api)
        asked = await asyncio.gather(
            *(api.ask(tokens["agent"], {"user": "alice"}, expires_in=2) for _ in range(24))
        )
        ids = [q["id"] for q in asked]
        assert len(owners(client, ids)) == 3
        listener = client.server.app[LISTENER]

        # Nothing reads the questions until the listener is done: a read after the deadline
        # expires the question itself (as it should), which made the count race the reads.
        async def all_expired_by_the_listener() -> bool:
            return listener.expired == len(ids)

        await eventually(all_expired_by_the_listener, within=15, what="the listener expired all 24")
        fetched = await asyncio.gather(*(api.get(tokens["agent"], q) for q in ids))
        assert [f.body["state"] for f in fetched] == ["expired"] * len(ids)
        assert listener.expired == len(ids)  # the reads found them expired: none expired again
    finally:
        await close_client(client)


async def test_event_relay_and_hub_deliver_every_event_from_every_bucket(
    cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    tokens = await setup_people(cluster_api)
    hub = cluster_client.server.app[EVENT_HUB]
    subscriber = hub.subscribe("alice", "0-0")
    try:
        ids = [q["id"] for q in await ask_many(cluster_api, tokens["agent"], 32)]
        for question_id in ids:
            await cluster_api.answer(tokens["alice"], question_id, "no")
        seen: dict[str, list[str]] = {q: [] for q in ids}
        async with asyncio.timeout(20):
            while sum(map(len, seen.values())) < 2 * len(ids):
                event = await subscriber.queue.get()
                assert event is not None
                question_id = event.data.split('"id":"', 1)[1][:25]
                seen[question_id].append(event.type)
        assert all(kinds == ["question.created", "question.resolved"] for kinds in seen.values()), seen
    finally:
        hub.unsubscribe(subscriber)


async def test_the_relay_makes_its_group_again_when_the_outboxes_are_lost(
    cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    """A primary restarted without persistence (or a FLUSHALL) loses the outboxes with their
    consumer groups; the next create's XADD makes the stream again, without the group. Each
    bucket's reader on a cluster goes on after an error, so it must make the group again itself:
    it read NOGROUP forever, and no event reached anyone until the process restarted."""
    tokens = await setup_people(cluster_api)
    redis, keys = cluster_client.server.app[REDIS], cluster_client.server.app[STORE].keys
    alice_events = keys.events("alice")

    async def relayed(count: int) -> bool:
        return bool(await redis.xlen(alice_events) == count)

    await ask_many(cluster_api, tokens["agent"], 1)
    await eventually(lambda: relayed(1), within=10, what="the first event")
    for b in range(BUCKETS):
        await redis.delete(keys.outbox(b))
    await ask_many(cluster_api, tokens["agent"], 5)
    await eventually(lambda: relayed(6), within=20, what="the events after the loss")


async def test_noscript_on_every_primary_is_recovered_not_surfaced(
    cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    tokens = await setup_people(cluster_api)
    ids = [q["id"] for q in await ask_many(cluster_api, tokens["agent"], 16)]
    cluster: RedisCluster = as_cluster(cluster_client.server.app[REDIS])
    await cluster.script_flush()  # every primary
    replies = await asyncio.gather(*(cluster_api.answer(tokens["alice"], q, "yes") for q in ids))
    assert [(r.status, r.body["applied"]) for r in replies] == [(200, True)] * len(ids)


async def test_wait_replicas_confirms_answers_and_counts_what_replicas_did_not_confirm(
    cluster_server: ClusterServer,
) -> None:
    for replicas, timeout_ms, confirmed in ((1, 2000, True), (3, 20, False)):
        settings = test_settings(cluster_server.url, wait_replicas=replicas, wait_timeout_ms=timeout_ms)
        client = await start_client(settings)
        try:
            api = Api(client, ADMIN_TOKEN)
            tokens = await setup_people(api)
            ids = [q["id"] for q in await ask_many(api, tokens["agent"], 12)]
            replies = await asyncio.gather(*(api.answer(tokens["alice"], q, "yes") for q in ids))
            assert all(r.status == 200 and r.body["applied"] for r in replies)
            unconfirmed = client.server.app[SCRIPTS].coalescer.replication_unconfirmed
            # Each primary has one replica: one is confirmed, three cannot be.
            assert (unconfirmed == 0) is confirmed, unconfirmed
        finally:
            await close_client(client)
