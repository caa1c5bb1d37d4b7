"""Long-poll waiters: woken once with the final envelope, multiplexed on one subscription per
question per process, surviving a pub/sub connection kill, and unsubscribing when the last leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.http.appkeys import STORE, WAITERS
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import ChannelTap, Http, eventually, unbounded_session
from tests.redis_server import RedisServer


async def numsub(redis: Redis, channel: str) -> int:
    return int((await redis.pubsub_numsub(channel))[0][1])


async def until_waiting(
    client: TestClient[object, object], count: int, tasks: Sequence[asyncio.Task[Any]] = ()
) -> None:
    """Until `count` requests wait; a wait request that already returned fails the test at once."""
    waiters = client.server.app[WAITERS]

    async def ready() -> bool:
        returned = [t.result() for t in tasks if t.done()]
        statuses = Counter(status for status, _ in returned)
        assert not returned, f"{len(returned)} waits returned early, statuses {statuses}: {returned[0]}"
        return waiters.waiting == count

    await eventually(ready, within=30, what=f"{count} waiters registered")


async def until_unsubscribed(client: TestClient[object, object], redis: Redis, channel: str) -> None:
    async def gone() -> bool:
        return client.server.app[WAITERS].channels == 0 and await numsub(redis, channel) == 0

    await eventually(gone, within=5, what=f"{channel} unsubscribed")


@pytest.fixture
async def long_wait_client(redis_server: RedisServer) -> AsyncIterator[TestClient[object, object]]:
    client = await start_client(settings_for(redis_server.url, wait_max_seconds=60))
    yield client
    await close_client(client)


async def woken_by_the_transition(awaitable: Any) -> Any:
    """What a parked wait returns, well before its own timeout: a wait that timed out reads the
    question again and gets the same final state, so only this bound shows that the published
    envelope (not the fallback read at the timeout) woke it. A liveness bound, not a speed claim."""
    async with asyncio.timeout(WOKEN_WITHIN):
        return await awaitable


WOKEN_WITHIN = 5  # seconds; every wait it bounds asks for at least twice that


async def test_waiter_is_woken_exactly_once_with_the_final_envelope(
    api: Api, client: TestClient[object, object], redis: Redis
) -> None:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"})
    channel = client.server.app[STORE].channel(question["id"])

    async with ChannelTap(redis, [channel]) as tap:
        waiting = asyncio.create_task(api.wait(agent, question["id"], 10))
        await until_waiting(client, 1)
        assert await numsub(redis, channel) == 2  # the service's one subscription and the tap

        answered = await api.answer(alice, question["id"], "yes")
        # Stale taps, a stale cancel and reads afterwards publish nothing more.
        await api.answer(alice, question["id"], "no")
        await api.cancel(agent, question["id"])
        await api.get(agent, question["id"])
        woken = await waiting
        published = await tap.drain()

    assert answered.body["applied"] is True
    assert woken.status == 200
    assert woken.body == answered.body["question"]
    assert woken.body == (await api.get(agent, question["id"])).body
    assert len(published) == 1
    # A wait that starts after the end returns at once with the same envelope.
    assert (await api.wait(agent, question["id"], 10)).body == woken.body
    await until_unsubscribed(client, redis, channel)


@pytest.mark.parametrize(
    "foreign",
    [b"not json", b"[]", b'["id","x","state","answered"]', b'["state","pending","id","{id}"]'],
)
async def test_a_message_on_the_channel_that_is_not_the_final_state_wakes_nobody_with_it(
    api: Api, client: TestClient[object, object], redis: Redis, foreign: bytes
) -> None:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"})
    waiting = asyncio.create_task(api.wait(agent, question["id"], 10))
    await until_waiting(client, 1)

    await redis.publish(
        client.server.app[STORE].channel(question["id"]), foreign.replace(b"{id}", question["id"].encode())
    )
    await asyncio.sleep(0.2)
    assert not waiting.done()
    answered = await api.answer(alice, question["id"], "yes")
    assert (await woken_by_the_transition(waiting)).body == answered.body["question"]


async def test_a_member_removed_from_the_room_while_waiting_gets_404_not_the_answer(
    api: Api, client: TestClient[object, object]
) -> None:
    """As a fetch by them would, and as the batch wait already did: the wake-up is checked
    against the waiter's access again."""
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    bob = await api.principal("bob", "user")
    await api.room("ops", ["alice", "bob"])
    question = await api.ask(agent, {"room": "ops"})
    waiting = asyncio.create_task(api.wait(bob, question["id"], 10))
    await until_waiting(client, 1)
    await api.room("ops", ["alice"])

    assert (await api.answer(alice, question["id"], "yes")).body["applied"] is True
    woken = await woken_by_the_transition(waiting)
    assert woken.status == 404, woken.body
    assert "answer" not in woken.body


async def test_shutdown_returns_parked_waits_at_once_and_ends_event_streams(
    api: Api, client: TestClient[object, object]
) -> None:
    """SIGTERM runs on_shutdown before aiohttp waits for the handlers: parked long polls waited
    out their timeout (up to 60 s, past Kubernetes' 30 s grace) and streams stayed open."""
    agent = await api.principal("agent", "agent")
    await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"})
    single = asyncio.create_task(api.wait(agent, question["id"], 30))
    batch = asyncio.create_task(
        api.call("POST", "/v1/questions/wait", agent, {"ids": [question["id"]], "timeout": 30})
    )
    headers = {"Authorization": f"Bearer {agent}"}
    async with client.get("/v1/events", headers=headers) as stream:
        await until_waiting(client, 2)

        await client.server.app.shutdown()  # what SIGTERM runs first

        async with asyncio.timeout(10):  # a bound against hanging, not a speed check
            released, released_batch = await single, await batch
            rest = await stream.content.read()
    assert (released.status, released.body["state"]) == (200, "pending")
    assert (released_batch.status, released_batch.body["condition_met"]) == (200, False)
    assert rest.endswith(b"\n\n") or rest == b""


async def test_waiters_of_every_terminal_state_get_that_state(
    api: Api, client: TestClient[object, object], redis: Redis
) -> None:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    answered, cancelled, expired = [
        await api.ask(agent, {"user": "alice"}, expires_in=e) for e in (60, 60, 1)
    ]
    waits = [asyncio.create_task(api.wait(agent, q["id"], 10)) for q in (answered, cancelled, expired)]
    await until_waiting(client, 3)
    await api.answer(alice, answered["id"], "no")
    await api.cancel(agent, cancelled["id"], "not needed")
    replies = await woken_by_the_transition(asyncio.gather(*waits))

    assert [r.body["state"] for r in replies] == ["answered", "cancelled", "expired"]
    for question, reply in zip((answered, cancelled, expired), replies, strict=True):
        assert reply.body == (await api.get(agent, question["id"])).body


async def test_1000_concurrent_waiters_share_one_subscription_and_are_all_woken_by_one_answer(
    long_wait_client: TestClient[object, object], redis: Redis
) -> None:
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    await api.room("ops", ["alice"])
    question = await api.ask(agent, {"room": "ops"})
    channel = client.server.app[STORE].channel(question["id"])
    waiters = client.server.app[WAITERS]

    async with unbounded_session() as session:
        http = Http(session, client)
        tokens = [agent if i % 2 else alice for i in range(1000)]
        waits = [asyncio.create_task(http.wait(token, question["id"], 60)) for token in tokens]
        try:
            await until_waiting(client, 1000, waits)
            assert waiters.channels == 1
            assert await numsub(redis, channel) == 1

            answered = await api.answer(alice, question["id"], "yes")
            async with asyncio.timeout(30):  # the 60 s waits' own timeout would also end them
                replies = await asyncio.gather(*waits)
        finally:
            for task in waits:
                task.cancel()

    assert answered.body["applied"] is True
    assert {status for status, _ in replies} == {200}
    assert all(body == answered.body["question"] for _, body in replies)
    await until_unsubscribed(client, redis, channel)


async def test_waiters_survive_a_pubsub_connection_kill_while_answers_land_during_the_outage(
    long_wait_client: TestClient[object, object], redis: Redis
) -> None:
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    app = client.server.app
    store = app[STORE]
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    questions = [await api.ask(agent, {"user": "alice"}) for _ in range(50)]
    ids = [q["id"] for q in questions]

    async with unbounded_session() as session:
        http = Http(session, client)
        waits = [asyncio.create_task(http.wait(agent, ids[i % 50], 20)) for i in range(100)]
        try:
            await until_waiting(client, 100, waits)
            assert app[WAITERS].channels == 50
            resubscriptions = app[WAITERS].resubscriptions

            # Kill every pub/sub connection and answer half the questions in the same MULTI:
            # those publishes reach no subscriber, for certain.
            answer = store.scripts.lua["answer"]
            async with redis.pipeline(transaction=True) as pipe:
                pipe.client_kill_filter(_type="pubsub")
                for question_id in ids[:25]:
                    keys = answer.keys(store._transition_keys(question_id))
                    args = answer.args(
                        {
                            "id": question_id,
                            "responder": "alice",
                            "option": "yes",
                            "call id": f"outage-{question_id}",
                            "responder rooms": "||",
                            "retention": store.retention_ms,
                            "outbox maxlen": store.outbox_maxlen,
                        }
                    )
                    pipe.eval(answer.source, len(keys), *keys, *args)
                results = await pipe.execute()
            assert results[0] >= 1
            assert [r[0] for r in results[1:]] == ["applied"] * 25
            # The other half through the service, right away, while it reconnects.
            late = await asyncio.gather(*(http.answer(alice, q, "no") for q in ids[25:]))
            assert all(status == 200 and body["applied"] for status, body in late)

            async with asyncio.timeout(10):  # well before the waiters' own 20 s timeout
                replies = await asyncio.gather(*waits)
        finally:
            for task in waits:
                task.cancel()

    assert app[WAITERS].resubscriptions > resubscriptions
    for i, (status, body) in enumerate(replies):
        assert status == 200
        assert body["state"] == "answered"
        assert body == (await api.get(agent, ids[i % 50])).body
        assert body["answer"]["option"] == ("yes" if i % 50 < 25 else "no")
    for question_id in ids:
        await until_unsubscribed(client, redis, store.channel(question_id))


async def test_wait_that_times_out_returns_the_pending_envelope_and_unsubscribes(
    api: Api, client: TestClient[object, object], redis: Redis
) -> None:
    agent = await api.principal("agent", "agent")
    await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"})
    channel = client.server.app[STORE].channel(question["id"])

    replies = await asyncio.gather(
        api.wait(agent, question["id"], 0.3),
        api.call("GET", f"/v1/questions/{question['id']}/wait", agent, headers={"Prefer": "wait=0.3"}),
    )

    for reply in replies:
        assert reply.status == 200
        assert reply.body == question
        assert reply.body["state"] == "pending"
    assert replies[1].headers["Preference-Applied"] == "wait=0.3"
    await until_unsubscribed(client, redis, channel)


async def test_channel_is_unsubscribed_once_the_last_of_many_waiters_leaves(
    api: Api, client: TestClient[object, object], redis: Redis
) -> None:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"})
    channel = client.server.app[STORE].channel(question["id"])

    async with unbounded_session() as session:
        http = Http(session, client)
        short = [asyncio.create_task(http.wait(agent, question["id"], 0.5)) for _ in range(20)]
        long = [asyncio.create_task(http.wait(agent, question["id"], 10)) for _ in range(20)]
        await until_waiting(client, 40)
        timed_out = await asyncio.gather(*short)
        # The long waiters still hold the one subscription after the short ones left.
        assert client.server.app[WAITERS].waiting == 20
        assert await numsub(redis, channel) == 1
        answered = await http.answer(alice, question["id"], "no")
        woken = await woken_by_the_transition(asyncio.gather(*long))

    assert all(body == question for _, body in timed_out)
    assert all(body == answered[1]["question"] for _, body in woken)
    await until_unsubscribed(client, redis, channel)


async def test_waiter_arriving_while_the_channel_churns_is_still_woken(
    long_wait_client: TestClient[object, object], redis: Redis
) -> None:
    """Short waiters leave (unsubscribe) just as a long one arrives (subscribe), over and over at
    slightly different moments; every long waiter must hold a live subscription and be woken."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    store = client.server.app[STORE]
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    questions = [await api.ask(agent, {"user": "alice"}) for _ in range(20)]

    async with unbounded_session() as session:
        http = Http(session, client)
        stayers = []
        try:
            for trial, question in enumerate(questions):
                blips = [asyncio.create_task(http.wait(agent, question["id"], 0.05)) for _ in range(3)]
                await asyncio.sleep(0.04 + trial * 0.001)  # arrive around the blips' departure
                stayers.append(asyncio.create_task(http.wait(agent, question["id"], 30)))
                await asyncio.gather(*blips)
            await until_waiting(client, len(questions), stayers)
            for question in questions:
                assert await numsub(redis, store.channel(question["id"])) == 1, question["id"]
            answers = await asyncio.gather(*(http.answer(alice, q["id"], "yes") for q in questions))
            async with asyncio.timeout(10):  # woken, not timed out (the waits run 30 s)
                woken = await asyncio.gather(*stayers)
        finally:
            for task in stayers:
                task.cancel()

    for (_, answered), (status, body) in zip(answers, woken, strict=True):
        assert status == 200
        assert body == answered["question"]
    for question in questions:
        await until_unsubscribed(client, redis, store.channel(question["id"]))


async def test_waiter_unsubscribed_under_it_subscribes_again_and_is_still_woken(
    long_wait_client: TestClient[object, object], redis: Redis
) -> None:
    """An earlier waiter's UNSUBSCRIBE that overtakes this one's SUBSCRIBE (redis-py retries it
    across a reconnect) leaves a parked waiter with no subscription: it must subscribe again and
    re-read, not sleep until its timeout while the answer's publish goes to nobody."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    waiters = client.server.app[WAITERS]
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    question = await api.ask(agent, {"user": "alice"})
    channel = client.server.app[STORE].channel(question["id"])
    waiting = asyncio.create_task(api.wait(agent, question["id"], 30))
    await until_waiting(client, 1, [waiting])
    resubscribed = waiters.resubscriptions

    await waiters._pubsub.unsubscribe(channel)  # the stray unsubscribe, on the service's connection

    async def unsubscribed_or_healed() -> bool:
        return waiters.resubscriptions > resubscribed or await numsub(redis, channel) == 0

    await eventually(unsubscribed_or_healed, within=5, what="the stray unsubscribe reached Redis")
    answered = await api.answer(alice, question["id"], "yes")
    async with asyncio.timeout(10):  # woken, not timed out (the wait runs 30 s)
        woken = await waiting
    assert woken.body == answered.body["question"]
    assert waiters.resubscriptions > resubscribed


async def test_envelope_from_pubsub_wake_up_is_identical_to_fetch_with_unicode_content(
    api: Api, client: TestClient[object, object]
) -> None:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    prompt = 'Déployer 🚀 "prod"/staging?\n\\ tab\t<b>&amp; \u2028 end'
    metadata = {"ünï": ["💥", 1.5, None, True, {"a/b": "c\\d"}], "empty": {}, "list": []}
    answered_q = await api.ask(
        agent, {"user": "alice"}, options=("oui", "non"), prompt=prompt, metadata=metadata
    )
    cancelled_q = await api.ask(agent, {"user": "alice"}, prompt=prompt, metadata=metadata)

    waits = [asyncio.create_task(api.wait(agent, q["id"], 10)) for q in (answered_q, cancelled_q)]
    await until_waiting(client, 2)
    answered = await api.answer(alice, answered_q["id"], "oui")
    cancelled = await api.cancel(agent, cancelled_q["id"], 'annulé — «raison» 🙅 "quoted"')
    woken = await woken_by_the_transition(asyncio.gather(*waits))

    for reply, wake in zip((answered, cancelled), woken, strict=True):
        fetched = await api.get(agent, reply.body["question"]["id"])
        assert wake.body == reply.body["question"] == fetched.body
        assert wake.body["prompt"] == prompt
        assert wake.body["metadata"] == metadata
    assert woken[1].body["cancellation"]["reason"] == 'annulé — «raison» 🙅 "quoted"'


async def test_concurrent_first_waits_on_a_fresh_process_share_one_pubsub_connection(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py lets racing first subscribes each take a connection; only one is ever read, so
    without the connect lock some of these waiters would sleep until their timeout."""
    client = await start_client(settings_for(redis_server.url, wait_max_seconds=30))
    try:
        api = Api(client, ADMIN_TOKEN)
        agent = await api.principal("agent", "agent")
        alice = await api.principal("alice", "user")
        ids = [(await api.ask(agent, {"user": "alice"}))["id"] for _ in range(50)]
        waiters = client.server.app[WAITERS]
        pool = waiters._pubsub.connection_pool
        plain_get = pool.get_connection

        async def slow_get(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.01)  # as when the pool must dial a new connection
            return await plain_get(*args, **kwargs)

        monkeypatch.setattr(pool, "get_connection", slow_get)
        # All 50 first subscribes start in the same event-loop turn, on a never-used PubSub.
        waits = [asyncio.create_task(waiters.wait(q, 20)) for q in ids]
        await eventually(lambda: _true(waiters.waiting == 50), within=10, what="50 waiters registered")
        await asyncio.sleep(0.2)
        monkeypatch.undo()
        await asyncio.gather(*(api.answer(alice, q, "yes") for q in ids))
        async with asyncio.timeout(10):  # far below the 20 s wait
            woken = await asyncio.gather(*waits)
        assert [q.state.value if q else None for q in woken] == ["answered"] * 50
    finally:
        await close_client(client)


async def _true(value: bool) -> bool:
    return value


async def test_racing_reconnects_of_the_pubsub_connection_leave_no_socket_open_behind(
    long_wait_client: TestClient[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py reconnects the pub/sub connection from whichever task's command failed (the
    reader's read, a SUBSCRIBE, an UNSUBSCRIBE), each calling the connection's connect. Racing
    connects each opened a socket and the later overwrote the earlier, which stayed open and
    subscribed until the garbage collector closed it (a ResourceWarning in a chaos run). Every
    socket the connection opened and no longer uses must be closed, and waiting still works."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    question_id = (await api.ask(agent, {"user": "alice"}))["id"]
    waiters = client.server.app[WAITERS]
    wait = asyncio.create_task(waiters.wait(question_id, 30))
    await until_waiting(client, 1)
    connection = waiters._pubsub.connection
    assert connection is not None
    opened: list[asyncio.StreamWriter] = []
    plain_open = connection._connect

    async def recorded_open() -> None:
        await plain_open()
        opened.append(connection._writer)

    monkeypatch.setattr(connection, "_connect", recorded_open)
    await connection.disconnect()
    await asyncio.gather(*(connection.connect() for _ in range(10)))

    async def settled() -> bool:
        return connection.is_connected and waiters.confirming == 0

    await eventually(settled, within=10, what="the pub/sub connection back")
    assert opened, "no reconnect happened: the test proved nothing"
    left_open = [w for w in opened if w is not connection._writer and not w.transport.is_closing()]
    assert left_open == [], f"{len(left_open)} of {len(opened)} sockets left open"
    await api.answer(alice, question_id, "yes")
    async with asyncio.timeout(10):
        woken = await wait
    assert woken is not None
    assert woken.state.value == "answered"


async def test_a_waiter_joining_a_subscribe_whose_caller_went_away_is_still_woken(
    long_wait_client: TestClient[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first waiter on a channel sends its SUBSCRIBE; a second joins and awaits that
    confirmation. When the first request goes away mid-SUBSCRIBE (its client hung up), the
    second must neither sit out its timeout on a confirmation nobody will give nor park on a
    channel nobody subscribed."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    waiters = client.server.app[WAITERS]
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    await waiters.wait((await api.ask(agent, {"user": "alice"}))["id"], 0.01)  # connected
    question_id = (await api.ask(agent, {"user": "alice"}))["id"]
    plain_subscribe = waiters._pubsub.subscribe
    sent = asyncio.Event()

    async def unanswered_subscribe(*channels: str) -> None:
        sent.set()
        await asyncio.Event().wait()  # Redis slow to reply; only the cancel ends it

    monkeypatch.setattr(waiters._pubsub, "subscribe", unanswered_subscribe)
    first = asyncio.create_task(waiters.wait(question_id, 30))
    await asyncio.wait_for(sent.wait(), 5)
    monkeypatch.setattr(waiters._pubsub, "subscribe", plain_subscribe)
    second = asyncio.create_task(waiters.wait(question_id, 30))
    await eventually(lambda: _true(waiters.waiting == 2), within=5, what="both waiting")
    first.cancel()
    await eventually(lambda: _true(waiters.confirming == 0), within=5, what="the channel settled")
    await api.answer(alice, question_id, "yes")
    async with asyncio.timeout(10):  # woken, not timed out (the wait runs 30 s)
        woken = await second
    assert woken is not None
    assert woken.state.value == "answered"


async def test_a_stray_message_on_a_question_channel_does_not_stop_the_waiters(
    long_wait_client: TestClient[object, object], redis: Redis
) -> None:
    """Anything may PUBLISH on a channel (a script of an older release, an operator's redis-cli):
    a message that is not an envelope is logged and skipped, and every waiter is still woken."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    question_id = (await api.ask(agent, {"user": "alice"}))["id"]
    channel = client.server.app[STORE].channel(question_id)
    waiting = asyncio.create_task(api.wait(agent, question_id, 30))
    await until_waiting(client, 1, [waiting])
    assert await redis.publish(channel, "not an envelope") == 1
    await asyncio.sleep(0.2)  # the reader has read it
    answered = await api.answer(alice, question_id, "yes")
    async with asyncio.timeout(10):
        woken = await waiting
    assert woken.body == answered.body["question"]


async def test_a_wait_cancelled_while_its_subscribe_absorbs_the_cancel_still_ends_at_once(
    long_wait_client: TestClient[object, object], redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's asyncio.wait_for, around redis-py's write of the SUBSCRIBE, drops a cancel
    that arrives as the write completes. The client that hung up must still release its wait then,
    not at its timeout, and the channel must not stay subscribed for nobody."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    waiters = client.server.app[WAITERS]
    agent = await api.principal("agent", "agent")
    await api.principal("alice", "user")
    question_id = (await api.ask(agent, {"user": "alice"}))["id"]
    plain_subscribe = waiters._pubsub.subscribe
    writing = asyncio.Event()

    async def absorbing_subscribe(*channels: str) -> None:
        writing.set()
        # What wait_for does when the inner write completes together with the cancel: drop it.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.5)  # the write under way
        await plain_subscribe(*channels)

    monkeypatch.setattr(waiters._pubsub, "subscribe", absorbing_subscribe)
    wait = asyncio.create_task(waiters.wait(question_id, 30))
    await asyncio.wait_for(writing.wait(), 5)
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):  # not the wait's 30 s
            await wait
    await until_unsubscribed(client, redis, client.server.app[STORE].channel(question_id))


async def test_an_unexpected_error_in_the_pubsub_read_does_not_end_the_reader(
    long_wait_client: TestClient[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py's reconnect racing the reader's read raises what a dropped connection does not
    ("read() called while another coroutine is already waiting", a handshake reply). The reader
    is every waiter's only way to wake: it starts the connection over and reads on."""
    client = long_wait_client
    api = Api(client, ADMIN_TOKEN)
    waiters = client.server.app[WAITERS]
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    earlier = (await api.ask(agent, {"user": "alice"}))["id"]
    parked = asyncio.create_task(api.wait(agent, earlier, 30))  # subscribed before the failure
    await until_waiting(client, 1, [parked])
    plain_next = waiters._next_message
    failed = asyncio.Event()

    async def racing_read() -> Any:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("read() called while another coroutine is already waiting for incoming data")
        return await plain_next()

    monkeypatch.setattr(waiters, "_next_message", racing_read)
    await asyncio.wait_for(failed.wait(), 5)
    later = (await api.ask(agent, {"user": "alice"}))["id"]
    waiting = asyncio.create_task(api.wait(agent, later, 30))
    answers = [await api.answer(alice, q, "yes") for q in (earlier, later)]
    async with asyncio.timeout(10):  # not the waits' 30 s
        woken = [await parked, await waiting]
    assert [w.body for w in woken] == [a.body["question"] for a in answers]
    assert waiters._reader is not None
    assert not waiters._reader.done()
