"""Deadlines: expiry without any reader (keyspace hint alone, sweeper alone), nothing expiring
early, late answers and cancels never applying, expiry dated at the deadline, retention and
removal, and many sweepers at once expiring each question exactly once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.http.appkeys import LISTENER, STORE, SWEEPER
from service.keys import BUCKETS, Keys, bucket_of
from service.scripts import Code
from service.settings import Settings
from service.sweeper import EXPIRED_EVENT, Sweeper
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import (
    eventually,
    keys_of,
    loop_time_of,
    ms,
    new_question,
    open_store,
    outbox_events,
    question_hash,
    redis_ms,
    rfc3339,
    sleep_until,
    sleep_until_redis_ms,
    stats_totals,
)
from tests.redis_server import RedisServer

GRACE_MS = 2000  # the contract: expired within 2 s after the deadline, with nobody reading


@pytest.fixture
async def notifications_restored(redis: Redis) -> AsyncIterator[None]:
    """Tests may switch keyspace notifications on the shared server; put the setting back."""
    saved = (await redis.config_get("notify-keyspace-events"))["notify-keyspace-events"]
    yield
    await redis.config_set("notify-keyspace-events", saved)


async def app_with(redis_server: RedisServer, **changes: object) -> tuple[TestClient[object, object], Api]:
    client = await start_client(settings_for(redis_server.url, **changes))
    return client, Api(client, ADMIN_TOKEN)


async def watch_until_expired(redis: Redis, prefix: str, questions: list[dict[str, object]]) -> None:
    """Poll Redis directly (HGET state, bracketed by TIME in one MULTI) every 50 ms. Nothing may be
    expired before its deadline; everything must be expired within GRACE_MS after it."""
    keys = Keys(prefix)
    deadlines = {str(q["id"]): ms(str(q["expires_at"])) for q in questions}
    left = set(deadlines)
    while left:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.time()
            for question_id in deadlines:
                pipe.hget(keys.for_question(question_id).question, "state")
            pipe.time()
            replies = await pipe.execute()
        before = int(replies[0][0]) * 1000 + int(replies[0][1]) // 1000
        after = int(replies[-1][0]) * 1000 + int(replies[-1][1]) // 1000
        for (question_id, deadline), state in zip(deadlines.items(), replies[1:-1], strict=True):
            if state == "expired":
                assert after >= deadline, f"{question_id} expired at or before {after}, deadline {deadline}"
                left.discard(question_id)
            else:
                assert state == "pending", f"{question_id} became {state} though nobody touched it"
                assert before < deadline + GRACE_MS, (
                    f"{question_id} still pending {before - deadline} ms late"
                )
        await asyncio.sleep(0.05)


async def test_untouched_question_expires_within_2s_by_keyspace_notification_alone() -> None:
    # Its own Redis: Redis fires an expiry event only when its active-expiry cycle deletes the
    # marker key, and on a server crowded with other tests' TTL keys that can lag for seconds.
    # That lag is why the sweeper, not the event, is the enforcer (next tests).
    server = RedisServer().start()
    redis = Redis.from_url(server.url, decode_responses=True)
    client, api = await app_with(server, run_sweeper=False, keyspace_notifications=True)
    try:
        agent = await api.principal("agent", "agent")
        await api.principal("alice", "user")

        async def listening() -> bool:
            return bool((await redis.pubsub_numsub(EXPIRED_EVENT.format(db=0)))[0][1])

        await eventually(listening, within=5, what="the keyspace listener subscribed")
        assert "E" in (await redis.config_get("notify-keyspace-events"))["notify-keyspace-events"]
        questions = [await api.ask(agent, {"user": "alice"}, expires_in=1 + i % 2) for i in range(6)]

        await watch_until_expired(redis, client.server.app[STORE].keys.prefix, questions)

        assert client.server.app[LISTENER].expired == len(questions)
        for question in questions:
            final = (await api.get(agent, str(question["id"]))).body
            assert final["state"] == "expired"
            assert final["resolved_at"] == final["expires_at"] == question["expires_at"]
    finally:
        await client.close()
        await redis.aclose()
        server.cleanup()


async def test_keyspace_notifications_are_enabled_again_after_redis_restarts() -> None:
    """A restarted Redis starts with its configured notify-keyspace-events (off here); the
    listener reconnected but never set them again, so only the sweeper noticed deadlines."""
    server = RedisServer().start()
    redis = Redis.from_url(server.url, decode_responses=True)
    client, _ = await app_with(server, run_sweeper=False, keyspace_notifications=True)

    async def events_on() -> bool:
        async with Redis.from_url(server.url, decode_responses=True) as fresh:
            return "E" in (await fresh.config_get("notify-keyspace-events"))["notify-keyspace-events"]

    try:
        await eventually(events_on, within=5, what="notifications enabled at start")
        server.stop()
        server.start()
        await eventually(events_on, within=15, what="notifications enabled again after the restart")
    finally:
        await client.close()
        await redis.aclose()
        server.cleanup()


async def test_untouched_question_expires_within_2s_with_notifications_and_sweeper_on(
    redis_server: RedisServer, redis: Redis
) -> None:
    """The production setup on a crowded server: whichever mechanism is first, within 2 s."""
    client, api = await app_with(redis_server, keyspace_notifications=True, sweep_interval_seconds=1.0)
    try:
        agent = await api.principal("agent", "agent")
        await api.principal("alice", "user")
        questions = [await api.ask(agent, {"user": "alice"}, expires_in=1 + i % 2) for i in range(6)]
        await watch_until_expired(redis, client.server.app[STORE].keys.prefix, questions)
        app = client.server.app
        assert app[LISTENER].expired + app[SWEEPER].totals.expired == len(questions)
    finally:
        await client.close()


@pytest.mark.usefixtures("notifications_restored")
async def test_untouched_question_expires_within_2s_by_the_sweeper_alone(
    redis_server: RedisServer, redis: Redis
) -> None:
    await redis.config_set("notify-keyspace-events", "")
    client, api = await app_with(redis_server, keyspace_notifications=False, sweep_interval_seconds=1.0)
    try:
        agent = await api.principal("agent", "agent")
        await api.principal("alice", "user")
        questions = [await api.ask(agent, {"user": "alice"}, expires_in=1 + i % 2) for i in range(6)]

        await watch_until_expired(redis, client.server.app[STORE].keys.prefix, questions)

        assert client.server.app[SWEEPER].totals.expired == len(questions)
        assert client.server.app[LISTENER].expired == 0
        for question in questions:
            final = (await api.get(agent, str(question["id"]))).body
            assert final["state"] == "expired"
            assert final["resolved_at"] == final["expires_at"] == question["expires_at"]
    finally:
        await client.close()


@pytest.mark.parametrize("late", ["answer", "cancel"])
async def test_answer_or_cancel_after_the_deadline_never_applies_and_reports_expired(
    redis_server: RedisServer, redis: Redis, late: str
) -> None:
    # No sweeper, no listener: the question is still pending in Redis when the late call lands,
    # so the script's own deadline check is what refuses it.
    client, api = await app_with(redis_server, run_sweeper=False, keyspace_notifications=False)
    try:
        agent = await api.principal("agent", "agent")
        alice = await api.principal("alice", "user")
        question = await api.ask(agent, {"user": "alice"}, expires_in=1)
        key = client.server.app[STORE].keys.for_question(question["id"]).question
        await sleep_until_redis_ms(redis, ms(question["expires_at"]))
        assert await redis.hget(key, "state") == "pending"

        if late == "answer":
            reply = await api.answer(alice, question["id"], "yes")
        else:
            reply = await api.cancel(agent, question["id"], "too late")

        assert reply.status == 200
        assert reply.body["applied"] is False
        story = reply.body["question"]
        assert story["state"] == "expired"
        assert story["answer"] is None
        assert story["cancellation"] is None
        assert story["resolved_at"] == story["expires_at"] == question["expires_at"]
        assert (await api.get(agent, question["id"])).body == story
        again = await api.answer(alice, question["id"], "no")
        assert again.body == {"applied": False, "question": story}
    finally:
        await client.close()


async def test_answers_and_cancels_in_a_volley_across_the_deadline_apply_only_before_it(
    api: Api, redis: Redis
) -> None:
    """Many questions share one deadline (to the millisecond); answers and cancels land one after
    another from 150 ms before it to 150 ms after it, racing the sweeper and the keyspace hint."""
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    deadline = await redis_ms(redis) + 2500
    expires_at = rfc3339(deadline)
    questions = [
        await api.ask(agent, {"user": "alice"}, expires_in=None, expires_at=expires_at) for _ in range(120)
    ]
    assert {q["expires_at"] for q in questions} == {expires_at}

    start = await loop_time_of(redis, deadline - 150)
    replies = []
    for i, question in enumerate(questions):
        await sleep_until(start + i * 0.0025)
        if i % 3 == 2:
            replies.append(await api.cancel(agent, question["id"]))
        else:
            replies.append(await api.answer(alice, question["id"], "yes"))

    outcomes: Counter[str] = Counter()
    for question, reply in zip(questions, replies, strict=True):
        assert reply.status == 200
        story = reply.body["question"]
        outcomes[story["state"]] += 1
        final = (await api.get(agent, question["id"])).body
        assert final == story
        if reply.body["applied"]:
            assert story["state"] in ("answered", "cancelled")
            assert ms(story["resolved_at"]) < deadline
            if story["answer"] is not None:
                assert ms(story["answer"]["answered_at"]) < deadline
        else:
            assert story["state"] == "expired"
            assert story["resolved_at"] == expires_at
    # The volley really crossed the deadline: both sides of it were exercised.
    assert outcomes["expired"] > 0
    assert outcomes["answered"] + outcomes["cancelled"] > 0


async def test_expired_question_is_dated_at_its_deadline_whichever_path_expired_it(
    redis_server: RedisServer, redis: Redis
) -> None:
    client, api = await app_with(redis_server, run_sweeper=False, keyspace_notifications=False)
    try:
        agent = await api.principal("agent", "agent")
        alice = await api.principal("alice", "user")
        by_sweep, by_fetch, by_answer, by_list = [
            await api.ask(agent, {"user": "alice"}, expires_in=1) for _ in range(4)
        ]
        await sleep_until_redis_ms(redis, ms(by_list["expires_at"]) + 200)

        assert (await client.server.app[SWEEPER].store.expire_many([by_sweep["id"]])) == [Code.APPLIED]
        fetched = (await api.get(agent, by_fetch["id"])).body
        answered = (await api.answer(alice, by_answer["id"], "yes")).body["question"]
        listed = (await api.list(alice, state="expired")).body["items"]

        stories = {
            "sweep": (await api.get(agent, by_sweep["id"])).body,
            "fetch": fetched,
            "answer": answered,
            "list": next(q for q in listed if q["id"] == by_list["id"]),
        }
        for path, story in stories.items():
            assert story["state"] == "expired", path
            assert story["resolved_at"] == story["expires_at"], path
        assert len(listed) == 4
        assert (await stats_totals(redis, client.server.app[STORE].keys.prefix))["expired"] == 4
    finally:
        await client.close()


async def test_an_expiry_noticed_only_after_deadline_and_retention_is_still_readable_for_the_retention(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Every sweeper and listener down for longer than the retention: the expiry, dated at the
    deadline, must not be purged in the pass that records it ("expired" is a result, and a 404
    right after it is no result at all)."""
    client, api = await app_with(
        redis_server, retention_seconds=2, keyspace_notifications=False, run_sweeper=False
    )
    try:
        agent = await api.principal("agent", "agent")
        await api.principal("alice", "user")
        question = await api.ask(agent, {"user": "alice"}, expires_in=1)
        hash_key = client.server.app[STORE].keys.for_question(question["id"]).question
        expires_ms = int(await redis.hget(hash_key, "expires_ms") or 0)
        await sleep_until_redis_ms(redis, expires_ms + 2_500)  # nothing reads it meanwhile

        swept = await client.server.app[SWEEPER].sweep_once()

        assert (swept.expired, swept.purged) == (1, 0)
        fetched = await api.get(agent, question["id"])
        assert fetched.status == 200, fetched.body
        assert fetched.body["state"] == "expired"
        assert fetched.body["resolved_at"] == fetched.body["expires_at"]
    finally:
        await client.close()


async def test_terminal_questions_and_their_index_entries_are_removed_after_retention(
    redis_server: RedisServer, redis: Redis
) -> None:
    client, api = await app_with(redis_server, retention_seconds=1, keyspace_notifications=False)
    try:
        app = client.server.app
        prefix = app[STORE].keys.prefix
        keys = Keys(prefix)
        agent = await api.principal("agent", "agent")
        alice = await api.principal("alice", "user")
        await api.room("ops", ["alice"])
        answered = await api.ask(agent, {"user": "alice"})
        cancelled = await api.ask(agent, {"room": "ops"})
        expired = await api.ask(agent, {"room": "ops"}, expires_in=1)
        kept = await api.ask(agent, {"user": "alice"})
        assert (await api.answer(alice, answered["id"], "yes")).body["applied"] is True
        assert (await api.cancel(agent, cancelled["id"])).body["applied"] is True
        gone = [answered["id"], cancelled["id"], expired["id"]]

        async def all_removed() -> bool:
            names = await keys_of(redis, prefix)
            return not any(q in name for q in gone for name in names)

        await eventually(all_removed, within=8, every=0.1, what="terminal questions purged")

        indexes = [
            *(keys.asker_index(b, "agent") for b in range(BUCKETS)),
            *(keys.target_index(b, "user", "alice") for b in range(BUCKETS)),
            *(keys.target_index(b, "room", "ops") for b in range(BUCKETS)),
            *(keys.deadlines(b) for b in range(BUCKETS)),
            *(keys.purge(b) for b in range(BUCKETS)),
        ]
        members = [m for index in indexes for m in await redis.zrange(index, 0, -1)]
        assert not [m for m in members if any(q in m for q in gone)]
        assert app[SWEEPER].totals.purged == 3

        for question_id in gone:
            assert (await api.get(agent, question_id)).status == 404
        for listing in (await api.list(agent, role="asker"), await api.list(alice)):
            assert [q["id"] for q in listing.body["items"]] == [kept["id"]]
        # The pending question is untouched: its hash, deadline marker and index entries remain.
        assert (await question_hash(redis, prefix, kept["id"]))["state"] == "pending"
        assert await redis.exists(keys.for_question(kept["id"]).deadline_marker)
        assert sum([m.endswith(kept["id"]) for m in members]) == 3  # asker, target, deadlines
    finally:
        await client.close()


async def test_concurrent_sweepers_expire_2000_overdue_questions_exactly_once(
    redis_server: RedisServer, redis: Redis
) -> None:
    settings: Settings = settings_for(redis_server.url, sweep_batch=37)
    stores = [open_store(settings) for _ in range(4)]  # four "processes", each with its own client
    try:
        _, _, store = stores[0]
        ids: list[str] = []
        for chunk in range(10):
            replies = await asyncio.gather(
                *(store.create(new_question(asker=f"a{chunk}", expires_in_ms=300), None) for _ in range(200))
            )
            assert {r.code for r in replies} == {Code.CREATED}
            ids.extend(r.fields["id"] for r in replies if r.fields is not None)
        assert len(set(ids)) == 2000
        last = max(
            [int((await question_hash(redis, settings.key_prefix, q))["expires_ms"]) for q in ids[-200:]]
        )
        await sleep_until_redis_ms(redis, last + 1)

        sweepers = [Sweeper(s, interval=0.2) for _, _, s in stores for _ in range(2)]
        rounds = await asyncio.gather(*(s.sweep_once() for s in sweepers))
        rounds += await asyncio.gather(*(s.sweep_once() for s in sweepers))

        assert sum(r.expired for r in rounds) == 2000
        stats = await stats_totals(redis, settings.key_prefix)
        assert (stats["created"], stats["expired"]) == (2000, 2000)
        events = [
            e for e in await outbox_events(redis, settings.key_prefix) if e["type"] == "question.expired"
        ]
        assert len(events) == 2000
        assert Counter(e["id"] for e in events) == Counter(set(ids))
        async with redis.pipeline(transaction=False) as pipe:
            for question_id in ids:
                pipe.hmget(Keys(settings.key_prefix).for_question(question_id).question, "state", "version")
            states = await pipe.execute()
        assert Counter(tuple(s) for s in states) == {("expired", "2"): 2000}
        keys = Keys(settings.key_prefix)
        assert sum([await redis.zcard(keys.deadlines(b)) for b in range(BUCKETS)]) == 0
    finally:
        for client, _, _ in stores:
            await client.aclose()


async def test_a_sweep_ends_and_drops_deadline_entries_whose_question_hash_is_gone(
    redis_server: RedisServer, redis: Redis
) -> None:
    # A hash deleted outside purge.lua (an operator's DEL, eviction) left its deadline entry
    # behind; a full batch of those made sweep_once read the same batch forever.
    settings = settings_for(redis_server.url, sweep_batch=5)
    client, _, store = open_store(settings)
    try:
        deadlines = Keys(settings.key_prefix).deadlines(0)
        await redis.zadd(deadlines, {f"0{i:024x}": 1 for i in range(5)})
        result = await asyncio.wait_for(Sweeper(store, interval=0.2).sweep_once(), 10)
        assert result.expired == 0
        assert await redis.zcard(deadlines) == 0
    finally:
        await client.aclose()


async def test_purging_a_question_whose_hash_is_gone_drops_its_schedule_entry_and_counts_nothing(
    redis_server: RedisServer, redis: Redis
) -> None:
    # The hash can vanish between purge_many's read and the script (an operator's DEL): the
    # sweeper's purged total must not count a removal that did not happen.
    settings = settings_for(redis_server.url)
    client, _, store = open_store(settings)
    try:
        keys = Keys(settings.key_prefix)
        question_id = f"0{7:024x}"
        schedule = keys.purge(bucket_of(question_id))
        await redis.zadd(schedule, {question_id: 1})
        script_keys = {
            "question": keys.for_question(question_id).question,
            "purge": schedule,
            "asker index": keys.asker_index(0, "agent"),
            "target index": keys.target_index(0, "user", "alice"),
        }
        [reply] = await store.scripts.call_many("purge", [(script_keys, {"id": question_id})])
        assert reply.code is Code.STALE
        assert await redis.zscore(schedule, question_id) is None
    finally:
        await client.aclose()


async def test_a_read_just_before_the_deadline_sees_the_question_pending_and_it_can_be_answered(
    redis_server: RedisServer, redis: Redis
) -> None:
    """Reads expire an overdue question themselves (expire.lua): never one that is not overdue
    yet, however close. No sweeper and no keyspace events here, so only the reads decide."""
    client, api = await app_with(redis_server, run_sweeper=False, keyspace_notifications=False)
    try:
        agent = await api.principal("bot", "agent")
        alice = await api.principal("alice", "user")
        question = await api.ask(agent, {"user": "alice"}, expires_in=1)
        await sleep_until_redis_ms(redis, ms(question["expires_at"]) - 250)
        fetched = await api.get(agent, question["id"])
        waited = await api.wait(agent, question["id"], 0)
        listed = (await api.list(agent)).body["items"]
        assert [fetched.body["state"], waited.body["state"]] == ["pending", "pending"]
        assert [q["state"] for q in listed if q["id"] == question["id"]] == ["pending"]
        assert (await api.answer(alice, question["id"], "yes")).body["applied"] is True
    finally:
        await client.close()
