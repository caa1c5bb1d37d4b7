"""Coalesced script calls: one pipeline per event-loop turn, errors kept per call, NOSCRIPT healed."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service.auth import Directory
from service.coalesce import MAX_IN_FLIGHT
from service.http.appkeys import REDIS
from service.keys import Keys, new_question_id
from service.model import Kind, Principal
from service.questions import question_of
from service.scripts import CHUNK, Code, ScriptMisuse, Scripts
from service.settings import Settings
from service.store import QuestionStore
from tests.api import Api
from tests.conftest import test_settings
from tests.helpers_reliability import new_question
from tests.redis_server import RedisServer


@pytest.fixture
async def store(redis: Redis, redis_server: RedisServer) -> QuestionStore:
    return QuestionStore(redis, Scripts(redis), test_settings(redis_server.url))


def reads(store: QuestionStore, count: int) -> list[asyncio.Future[object]]:
    return [asyncio.ensure_future(store.read(new_question_id())) for _ in range(count)]


async def test_calls_issued_in_one_turn_share_one_pipeline(store: QuestionStore) -> None:
    coalescer = store.scripts.coalescer
    before = coalescer.batches
    results = await asyncio.gather(*reads(store, 200))
    assert results == [None] * 200
    assert coalescer.batches - before == 1
    assert coalescer.calls >= 200


async def test_calls_in_different_turns_are_separate_batches(store: QuestionStore) -> None:
    coalescer = store.scripts.coalescer
    before = coalescer.batches
    for _ in range(3):
        await store.read(new_question_id())
    assert coalescer.batches - before == 3


async def test_a_failing_call_does_not_fail_its_batch_neighbours(
    store: QuestionStore, redis: Redis, settings: Settings
) -> None:
    question_id = new_question_id()
    keys = Keys(settings.key_prefix).for_question(question_id)
    await redis.hset(keys.question, mapping={"state": "pending", "created_ms": "1"})
    await redis.zadd(keys.purge, {question_id: 0})
    purge_keys = {
        "question": keys.question,
        "purge": keys.purge,
        "asker index": keys.question + ":a",
        "target index": keys.question + ":t",
    }
    bad = store.scripts.call("purge", purge_keys, {"id": question_id})
    results = await asyncio.gather(bad, *reads(store, 5), return_exceptions=True)
    assert isinstance(results[0], ScriptMisuse)
    assert "pending" in str(results[0])
    assert results[1:] == [None] * 5


async def test_noscript_after_script_flush_is_healed_for_every_call_in_the_batch(
    store: QuestionStore, redis: Redis
) -> None:
    await store.read(new_question_id())
    await redis.script_flush()
    assert not any(await redis.script_exists(*store.scripts.shas()))
    results = await asyncio.gather(*reads(store, 20))
    assert results == [None] * 20
    expire_sha = store.scripts.lua["expire"].sha
    assert (await redis.script_exists(expire_sha)) == [True]


async def test_connection_failure_reaches_every_caller_of_the_batch() -> None:
    server = RedisServer().start()
    client = Redis.from_url(server.url, decode_responses=True)
    store = QuestionStore(client, Scripts(client), test_settings(server.url))
    try:
        await store.read(new_question_id())
        server.kill()
        results = await asyncio.gather(*reads(store, 10), return_exceptions=True)
        assert all(
            isinstance(r, (ConnectionError, OSError)) or "Connection" in type(r).__name__ for r in results
        ), results
    finally:
        await store.scripts.aclose()
        await client.aclose()
        server.cleanup()


async def test_sweeper_codes_arrive_in_call_order(store: QuestionStore) -> None:
    codes = await store.expire_many([new_question_id() for _ in range(50)])
    assert codes == [Code.NOT_FOUND] * 50


async def test_many_calls_go_in_chunks_and_each_reply_keeps_its_place(
    store: QuestionStore,
) -> None:
    pending = [question_of(await store.create(new_question(), None)).id for _ in range(3)]
    ids = [new_question_id() for _ in range(2 * CHUNK + 500)]
    places = (0, CHUNK, 2 * CHUNK + 7)
    for place, question_id in zip(places, pending, strict=True):
        ids[place] = question_id
    batches = store.scripts.coalescer.batches
    replies = await store.read_many(ids)
    assert store.scripts.coalescer.batches - batches >= 3  # Redis works on one while the next is packed
    assert [i for i, reply in enumerate(replies) if reply is not None] == list(places)
    assert [replies[place].id for place in places] == pending  # type: ignore[union-attr]


async def test_a_call_many_cancelled_between_chunks_leaves_later_calls_working(store: QuestionStore) -> None:
    unknown = [new_question_id() for _ in range(3 * CHUNK)]
    reading = asyncio.create_task(store.read_many(unknown))
    for _ in range(2):
        await asyncio.sleep(0)  # the first chunk is submitted, the task waits to submit the next
    assert not reading.done()
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    question = question_of(await store.create(new_question(), None))
    assert [q and q.id for q in await store.read_many([question.id, new_question_id()])] == [
        question.id,
        None,
    ]


async def test_at_most_a_few_batches_are_in_flight_and_later_calls_gather(store: QuestionStore) -> None:
    coalescer = store.scripts.coalescer
    futures = []
    for _ in range(50):  # 50 event-loop turns, 20 calls each, while earlier batches are out
        futures.extend(reads(store, 20))
        await asyncio.sleep(0)
    assert await asyncio.gather(*futures) == [None] * 1000
    assert coalescer.peak_in_flight <= MAX_IN_FLIGHT
    assert coalescer.batches < 50


async def test_reads_share_a_batch_with_script_calls_and_keep_their_own_replies_and_errors(
    store: QuestionStore, redis: Redis, settings: Settings
) -> None:
    members, profile = f"{settings.key_prefix}:members", f"{settings.key_prefix}:profile"
    await redis.sadd(members, "alice")
    await redis.hset(profile, "kind", "user")
    coalescer = store.scripts.coalescer
    before = coalescer.batches
    script_call = reads(store, 1)[0]  # a task: it submits its call before the flush runs
    results = await asyncio.gather(
        coalescer.read("SISMEMBER", members, "alice"),
        coalescer.read("SISMEMBER", profile, "alice"),  # WRONGTYPE: a hash is not a set
        script_call,
        coalescer.read("HGET", profile, "kind"),
        coalescer.read("SISMEMBER", members, "bob"),
        return_exceptions=True,
    )
    assert coalescer.batches - before == 1
    assert isinstance(results[1], ResponseError)
    assert "WRONGTYPE" in str(results[1])
    assert [results[0], results[2], results[3], results[4]] == [1, None, "user", 0]


async def test_reads_in_a_batch_healed_of_noscript_keep_their_replies(
    store: QuestionStore, redis: Redis, settings: Settings
) -> None:
    members = f"{settings.key_prefix}:members"
    await redis.sadd(members, "alice")
    await redis.script_flush()
    coalescer = store.scripts.coalescer
    before = coalescer.batches
    script_calls = reads(store, 5)  # tasks: they submit their calls before the flush runs
    plain_reads = [coalescer.read("SISMEMBER", members, "alice") for _ in range(5)]
    assert await asyncio.gather(*script_calls, *plain_reads) == [None] * 5 + [1] * 5
    assert coalescer.batches - before == 1


@contextlib.contextmanager
def pool_checkouts(redis: Redis, *, by: str = "") -> Iterator[list[int]]:
    """Counts the connections taken from `redis`' pool meanwhile (in the one-item list), or only
    those taken with a frame of the file `by` on the stack (background tasks take others)."""
    pool = redis.connection_pool
    taken = [0]
    get_connection = pool.get_connection

    async def counted() -> object:
        if not by or any(frame.filename.endswith(by) for frame in traceback.extract_stack()):
            taken[0] += 1
        return await get_connection()

    pool.get_connection = counted  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        del pool.get_connection


async def test_the_directorys_request_path_reads_take_no_pooled_connection(
    store: QuestionStore, redis: Redis, settings: Settings
) -> None:
    """Under a burst, reads that each took a pooled connection queued for the pool (the race
    storm of tests/test_races.py held all 64 with membership and token reads)."""
    directory = Directory(redis, Keys(settings.key_prefix), reads=store.scripts.coalescer)
    await directory.create_principal(Principal("alice", Kind.USER))
    await directory.set_members("room-1", ["alice"])
    token = (await directory.issue_token("alice")).token
    await store.read(new_question_id())  # the pipe's own connection is taken now
    with pool_checkouts(redis) as taken:
        results = await asyncio.gather(
            *(directory.is_member("room-1", "alice") for _ in range(100)),
            directory.is_member("room-1", "bob"),
            directory.room_exists("room-1"),
            directory.authenticate(token),
            directory.rooms_of("alice"),
        )
    assert results == [True] * 100 + [False, True, Principal("alice", Kind.USER), ["room-1"]]
    assert taken == [0]


async def test_a_room_members_first_fetch_list_and_answer_take_no_pooled_connection(api: Api) -> None:
    """The app wires its directory to the coalescer: the member's token, the membership checks,
    the list's rooms and index reads, and the scripts all go through the one pipelined connection
    (the outbox consumers that the answer wakes take pooled connections of their own, in the
    background)."""
    agent = await api.principal("agent-1", "agent")
    alice = await api.principal("alice", "user")
    await api.room("room-1", ["alice"])
    question = await api.ask(agent, {"room": "room-1"})
    with pool_checkouts(api.client.app[REDIS], by="service/http/routes.py") as taken:
        fetched = await api.get(alice, question["id"])  # alice's token is not cached yet
        listed = await api.list(alice, role="responder")
        answered = await api.answer(alice, question["id"], "yes")
    assert (fetched.status, listed.status, answered.status) == (200, 200, 200)
    assert [q["id"] for q in listed.body["items"]] == [question["id"]]
    assert answered.body["question"]["answer"]["responder"] == "alice"
    assert taken == [0]
