"""Re-run safety: a state-changing script run twice with the same call id (as a redis-py retry
does after a timeout) changes nothing the second time and reports the same outcome and envelope.
And NOSCRIPT: after SCRIPT FLUSH every path loads its scripts again by itself."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from service.delivery import Delivery, DeliveryStore
from service.http.appkeys import STORE, SWEEPER
from service.keys import bucket_of
from service.model import envelope
from service.outbound import Attempt, OutboundPolicy
from service.scripts import Code, Reply, ScriptMisuse, Scripts, VariadicCall
from service.settings import Settings
from service.store import QuestionStore, new_call_id
from service.webhooks import MAX_PER_OWNER, WebhookRegistry
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import (
    ChannelTap,
    Recorder,
    ms,
    new_question,
    open_store,
    outbox_events,
    sleep_until_redis_ms,
    snapshot,
    stats_totals,
)
from tests.redis_server import RedisServer


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[tuple[Redis, Scripts, QuestionStore]]:
    redis, scripts, store = open_store(settings)
    yield redis, scripts, store
    await redis.aclose()


async def created(store: QuestionStore, **kwargs: object) -> str:
    reply = await store.create(new_question(**kwargs), None)  # type: ignore[arg-type]
    assert reply.code is Code.CREATED
    assert reply.fields is not None
    return reply.fields["id"]


async def overdue(redis: Redis, store: QuestionStore) -> str:
    """A question whose deadline has passed and that nothing has expired yet."""
    question_id = await created(store, expires_in_ms=30)
    fields = await redis.hgetall(store.keys.for_question(question_id).question)
    await sleep_until_redis_ms(redis, int(fields["expires_ms"]) + 1)
    assert await redis.hget(store.keys.for_question(question_id).question, "state") == "pending"
    return question_id


async def run_twice(
    redis: Redis, store: QuestionStore, recorder: Recorder, question_id: str, first: Reply
) -> tuple[Reply, dict[str, object], dict[str, object], int]:
    """Re-run the recorded call; return its reply, the keyspace before and after it, and how many
    messages the question's channel carried during the re-run."""
    prefix = store.keys.prefix
    async with ChannelTap(redis, [store.channel(question_id)]) as tap:
        before = await snapshot(redis, prefix)
        second = await recorder.rerun_last()
        after = await snapshot(redis, prefix)
        published = len(await tap.drain())
    assert second.fields == first.fields
    return second, before, after, published


async def test_create_rerun_with_the_same_call_id_reports_created_and_writes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    recorder = Recorder(scripts)
    first = await qs.create(new_question(), "retry-me")
    assert first.code is Code.CREATED
    assert first.fields is not None
    question_id = first.fields["id"]

    second, before, after, _ = await run_twice(redis, qs, recorder, question_id, first)

    assert second.code is Code.CREATED
    assert after == before  # create publishes nothing on either run: only the keyspace can differ
    assert (await stats_totals(redis, qs.keys.prefix))["created"] == 1
    assert [e["type"] for e in await outbox_events(redis, qs.keys.prefix)] == ["question.created"]


async def test_answer_rerun_with_the_same_call_id_reports_applied_and_changes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    question_id = await created(qs)
    recorder = Recorder(scripts)
    async with ChannelTap(redis, [qs.channel(question_id)]) as tap:
        first = await qs.answer(question_id, "alice", "yes", [], new_call_id())
        assert len(await tap.drain()) == 1
    assert first.code is Code.APPLIED

    second, before, after, published = await run_twice(redis, qs, recorder, question_id, first)

    assert second.code is Code.APPLIED
    assert second.again
    assert not first.again
    assert after == before
    assert published == 0
    assert first.fields is not None
    assert envelope(first.fields)["answer"]["option"] == "yes"
    stats = await stats_totals(redis, qs.keys.prefix)
    assert stats["answered"] == 1
    assert stats["stale"] == 0
    events = [e["type"] for e in await outbox_events(redis, qs.keys.prefix)]
    assert events == ["question.created", "question.answered"]


async def test_stale_taps_are_each_counted_while_their_remembered_call_ids_stay_bounded(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """A client tapping a resolved question in a loop sends a new call id each time: each counts
    as one stale tap, but the set that remembers them (for retries) must not grow without end."""
    _, _, qs = store
    question_id = await created(qs)
    assert (await qs.answer(question_id, "alice", "yes", [], new_call_id())).code is Code.APPLIED
    calls = [new_call_id() for _ in range(1_500)]
    for call_id in calls:
        assert (await qs.answer(question_id, "alice", "no", [], call_id)).code is Code.STALE
    assert (await qs.answer(question_id, "alice", "no", [], calls[-1])).code is Code.STALE  # a retry
    assert (await stats_totals(redis, qs.keys.prefix))["stale"] == 1_500
    remembered = await redis.scard(qs.keys.for_question(question_id).stale_calls)
    assert 0 < remembered <= 1_000
    assert 0 < await redis.pttl(qs.keys.for_question(question_id).stale_calls) <= 600_000


async def test_cancel_rerun_with_the_same_call_id_reports_applied_and_changes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    question_id = await created(qs)
    recorder = Recorder(scripts)
    first = await qs.cancel(question_id, "agent", "changed my mind", any_asker=False, call_id=new_call_id())
    assert first.code is Code.APPLIED

    second, before, after, published = await run_twice(redis, qs, recorder, question_id, first)

    assert second.code is Code.APPLIED
    assert second.again
    assert not first.again
    assert after == before
    assert published == 0
    assert first.fields is not None
    assert envelope(first.fields)["cancellation"] == {"by": "agent", "reason": "changed my mind"}
    stats = await stats_totals(redis, qs.keys.prefix)
    assert stats["cancelled"] == 1
    assert stats["stale"] == 0
    events = [e["type"] for e in await outbox_events(redis, qs.keys.prefix)]
    assert events == ["question.created", "question.cancelled"]


async def test_expire_rerun_with_the_same_call_id_reports_applied_and_changes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    question_id = await overdue(redis, qs)
    recorder = Recorder(scripts)
    read = await qs.read(question_id)  # a fetch runs expire.lua, which expires it on the spot
    assert read is not None
    assert read.state == "expired"
    name, _, _ = recorder.calls[-1]
    assert name == "expire"
    first = recorder.replies[-1]
    assert first.code is Code.APPLIED

    second, before, after, published = await run_twice(redis, qs, recorder, question_id, first)

    assert second.code is Code.APPLIED
    assert second.again
    assert not first.again
    assert after == before
    assert published == 0
    stats = await stats_totals(redis, qs.keys.prefix)
    assert stats["expired"] == 1
    events = [e["type"] for e in await outbox_events(redis, qs.keys.prefix)]
    assert events == ["question.created", "question.expired"]


def expire_many_call(qs: QuestionStore, question_ids: list[str], call_ids: list[str]) -> VariadicCall:
    """One expire_many call for questions of one bucket, with the given call ids."""
    b = bucket_of(question_ids[0])
    keys = {"deadlines": qs.keys.deadlines(b), "purge": qs.keys.purge(b)}
    keys |= {"outbox": qs.keys.outbox(b), "stats": qs.keys.stats(b)}
    per_question = [arg for pair in zip(question_ids, call_ids, strict=True) for arg in pair]
    return keys, {"retention": 1000, "outbox maxlen": 1000}, qs._expiry_keys(question_ids), per_question


async def test_sweeper_batch_expiry_rerun_reports_again_and_changes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    question_id = await overdue(redis, qs)
    call = expire_many_call(qs, [question_id], ["c-batch"])
    first = await scripts.call_many_variadic("expire_many", [call])
    before = await snapshot(redis, qs.keys.prefix)
    async with ChannelTap(redis, [qs.channel(question_id)]) as tap:
        second = await scripts.call_many_variadic("expire_many", [call])
        published = len(await tap.drain())
    assert (first, second) == ([["applied"]], [["again"]])
    assert await snapshot(redis, qs.keys.prefix) == before
    assert published == 0
    assert (await stats_totals(redis, qs.keys.prefix))["expired"] == 1
    assert await qs.expire_many([question_id]) == [Code.STALE]  # another sweep's call id


async def test_batch_expiry_reports_each_question_by_its_own_state_in_input_order(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, _, qs = store
    gone, answered = await overdue(redis, qs), await created(qs)
    due, not_due = await overdue(redis, qs), await created(qs)
    await qs.answer(answered, "alice", "yes", [], new_call_id())
    await redis.delete(qs.keys.for_question(gone).question)  # an operator's DEL

    codes = await qs.expire_many([gone, answered, due, not_due])

    assert codes == [Code.NOT_FOUND, Code.STALE, Code.APPLIED, Code.PENDING]
    deadlines = qs.keys.deadlines(bucket_of(gone))
    assert await redis.zscore(deadlines, gone) is None  # the sweep will not find it again
    expired = [e["id"] for e in await outbox_events(redis, qs.keys.prefix) if e["type"] == "question.expired"]
    assert expired == [due]
    assert (await qs.read(not_due)).state == "pending"  # type: ignore[union-attr]


async def test_batch_expiry_with_keys_not_in_whole_questions_is_refused_as_misuse(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    question_id = await overdue(redis, qs)
    keys, args, more_keys, more_args = expire_many_call(qs, [question_id], ["c"])
    with pytest.raises(ScriptMisuse, match="not whole questions"):
        await scripts.call_many_variadic("expire_many", [(keys, args, more_keys[:2], more_args)])
    assert await redis.hget(qs.keys.for_question(question_id).question, "state") == "pending"


async def test_answer_whose_first_run_expired_the_question_inline_reruns_as_stale_not_applied(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    _, scripts, qs = store
    question_id = await overdue(redis, qs)
    recorder = Recorder(scripts)
    async with ChannelTap(redis, [qs.channel(question_id)]) as tap:
        first = await qs.answer(question_id, "alice", "yes", [], new_call_id())
        assert len(await tap.drain()) == 1  # the inline expiry published the terminal envelope
    assert first.code is Code.STALE
    assert first.fields is not None
    story = envelope(first.fields)
    assert story["state"] == "expired"
    assert story["answer"] is None
    assert story["resolved_at"] == story["expires_at"]

    second, _, _, published = await run_twice(redis, qs, recorder, question_id, first)

    assert second.code is Code.STALE
    assert published == 0
    stats = await stats_totals(redis, qs.keys.prefix)
    assert (stats["answered"], stats["expired"]) == (0, 1)
    events = [e["type"] for e in await outbox_events(redis, qs.keys.prefix)]
    assert events == ["question.created", "question.expired"]


@pytest.mark.parametrize("late", ["answer after answer", "cancel after answer", "answer after deadline"])
async def test_rerun_of_a_stale_call_changes_nothing_not_even_the_stale_counter(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis, late: str
) -> None:
    _, scripts, qs = store
    if late == "answer after deadline":
        question_id = await overdue(redis, qs)
    else:
        question_id = await created(qs)
        assert (await qs.answer(question_id, "alice", "no", [], new_call_id())).code is Code.APPLIED
    recorder = Recorder(scripts)
    if late.startswith("cancel"):
        first = await qs.cancel(question_id, "agent", "", any_asker=False, call_id=new_call_id())
    else:
        first = await qs.answer(question_id, "alice", "yes", [], new_call_id())
    assert first.code is Code.STALE

    second, before, after, published = await run_twice(redis, qs, recorder, question_id, first)

    assert second.code is Code.STALE
    assert (first.again, second.again) == (False, True)  # /metrics: one stale, then one replayed
    assert published == 0
    assert after == before, "a retried stale call must not count a second stale tap"


# -- NOSCRIPT -------------------------------------------------------------------------------------


async def test_every_route_works_after_script_flush(api: Api, redis: Redis) -> None:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    await api.room("ops", ["alice"])

    await redis.script_flush()
    answered = await api.ask(agent, {"user": "alice"})
    await redis.script_flush()
    cancelled = await api.ask(agent, {"room": "ops"})

    await redis.script_flush()
    fetched = await api.get(alice, answered["id"])
    assert fetched.status == 200
    assert fetched.body == answered

    await redis.script_flush()
    listed = await api.list(alice)
    assert listed.status == 200
    assert [q["id"] for q in listed.body["items"]] == [cancelled["id"], answered["id"]]

    await redis.script_flush()
    reply = await api.answer(alice, answered["id"], "yes")
    assert reply.status == 200
    assert reply.body["applied"] is True

    await redis.script_flush()
    waited = await api.wait(agent, answered["id"], 1)
    assert waited.status == 200
    assert waited.body == reply.body["question"]

    await redis.script_flush()
    reply = await api.cancel(agent, cancelled["id"])
    assert reply.status == 200
    assert reply.body["applied"] is True
    assert reply.body["question"]["state"] == "cancelled"

    await redis.script_flush()
    ready = await api.call("GET", "/readyz")
    assert ready.status == 200
    shas = api.client.server.app[STORE].scripts.shas()
    assert await redis.script_exists(*shas) == [True] * len(shas)


async def test_sweeper_expires_after_script_flush(redis_server: RedisServer, redis: Redis) -> None:
    settings = settings_for(redis_server.url, run_sweeper=False, keyspace_notifications=False)
    client = await start_client(settings)
    try:
        api = Api(client, ADMIN_TOKEN)
        agent = await api.principal("agent", "agent")
        await api.principal("alice", "user")
        question = await api.ask(agent, {"user": "alice"}, expires_in=1)
        app = client.server.app
        await sleep_until_redis_ms(redis, ms(question["expires_at"]))
        question_key = app[STORE].keys.for_question(question["id"]).question
        assert await redis.hget(question_key, "state") == "pending"

        await redis.script_flush()
        done = await app[SWEEPER].sweep_once()

        assert done.expired == 1
        assert await redis.hget(question_key, "state") == "expired"
        assert (await stats_totals(redis, settings.key_prefix))["expired"] == 1
    finally:
        await client.close()


async def stored_delivery(
    redis: Redis, qs: QuestionStore, delivery_id: str, **fields: str
) -> tuple[int, dict[str, str]]:
    """A delivery record of a fresh question, written as deliver_enqueue would: its bucket and
    fields."""
    question_id = await created(qs)
    b = bucket_of(question_id)
    record = {"id": delivery_id, "webhook": "wh_1", "url": "https://example.com/hook", "body": "{}",
              "type": "question.created", "question": question_id, "history": "[]", "created_ms": "1",
              **fields}  # fmt: skip
    await redis.hset(qs.keys.delivery(b, delivery_id), mapping=record)
    return b, record


async def test_settle_rerun_with_the_same_call_id_counts_the_attempt_once(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """redis-py resends a script whose reply was lost; counted twice, one failed attempt would
    cut the delivery's retries short (the next step of the schedule is picked by the count)."""
    _, scripts, qs = store
    b, fields = await stored_delivery(redis, qs, "msg_1", status="pending", attempts="0")
    deliveries = DeliveryStore(redis, scripts, qs.keys, retention_ms=60_000)
    recorder = Recorder(scripts)
    first = await deliveries.settle(Delivery.from_hash(fields), Attempt(503, "HTTP 503", 12), [5_000])
    before = await snapshot(redis, qs.keys.prefix)
    second = await recorder.rerun_last()
    assert (first.code, second.code) == (Code.APPLIED, Code.APPLIED)
    assert await snapshot(redis, qs.keys.prefix) == before
    record = await redis.hgetall(qs.keys.delivery(b, "msg_1"))
    assert record["attempts"] == "1"
    assert len(json.loads(record["history"])) == 1


async def test_two_senders_settling_the_same_attempt_step_through_the_schedule_once_each(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """A lease ran out while the first sender was still sending: a second sender claimed the
    delivery with the same attempt count and sent it too. Each attempt takes the next step of
    the schedule, and the attempt past its end dead-letters the delivery."""
    _, scripts, qs = store
    _, fields = await stored_delivery(redis, qs, "msg_3", status="pending", attempts="1")
    deliveries = DeliveryStore(redis, scripts, qs.keys, retention_ms=60_000)
    seen_by_both = Delivery.from_hash(fields)  # attempts 1 when each claimed it
    first = await deliveries.settle(seen_by_both, Attempt(503, "HTTP 503", 12), [1_000, 60_000])
    assert first.fields is not None
    assert (first.fields["status"], first.fields["attempts"]) == ("pending", "2")
    assert int(first.fields["next_ms"]) - int(first.fields["last_ms"]) == 60_000
    second = await deliveries.settle(seen_by_both, Attempt(503, "HTTP 503", 9), [1_000, 60_000])
    assert second.fields is not None
    assert (second.fields["status"], second.fields["attempts"]) == ("dead", "3")


async def test_a_late_settle_of_a_delivered_delivery_is_stale_and_changes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """A sender whose lease ran out settles after another sender delivered: its failure must
    not turn the delivered record back into a retry, or into a dead letter."""
    _, scripts, qs = store
    b, fields = await stored_delivery(redis, qs, "msg_4", status="pending", attempts="0")
    deliveries = DeliveryStore(redis, scripts, qs.keys, retention_ms=60_000)
    claimed = Delivery.from_hash(fields)
    delivered = await deliveries.settle(claimed, Attempt(200, "", 5), [1_000])
    assert delivered.code is Code.APPLIED
    record = await redis.hgetall(qs.keys.delivery(b, "msg_4"))
    late = await deliveries.settle(claimed, Attempt(0, "no response within 10 s", 10_000), [])
    assert late.code is Code.STALE
    assert await redis.hgetall(qs.keys.delivery(b, "msg_4")) == record
    assert await redis.zscore(qs.keys.deliveries_due(b), "msg_4") is None


async def test_replay_rerun_with_the_same_call_id_reports_applied_and_changes_nothing(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """A replay whose reply was lost, resent by redis-py, must not tell the admin it failed."""
    _, scripts, qs = store
    b, _ = await stored_delivery(redis, qs, "msg_2", status="dead", attempts="3")
    entry = await redis.xadd(qs.keys.dead_letters(b), {"id": "msg_2"})
    await redis.hset(qs.keys.delivery(b, "msg_2"), "dead_entry", entry)
    deliveries = DeliveryStore(redis, scripts, qs.keys, retention_ms=60_000)
    recorder = Recorder(scripts)
    first = await deliveries.replay("msg_2")
    before = await snapshot(redis, qs.keys.prefix)
    second = await recorder.rerun_last()
    assert first["status"] == "pending"
    assert second.code is Code.APPLIED
    assert await snapshot(redis, qs.keys.prefix) == before


async def test_claim_rerun_with_the_same_call_id_returns_what_the_lost_reply_leased(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """Without the memo, a re-sent claim found those deliveries leased (to a reply nobody read)
    and returned nothing: they waited out the whole lease before anyone sent them."""
    _, scripts, qs = store
    b, _ = await stored_delivery(redis, qs, "msg_3", status="pending", attempts="0")
    await redis.zadd(qs.keys.deliveries_due(b), {"msg_3": 0})
    deliveries = DeliveryStore(redis, scripts, qs.keys, retention_ms=60_000)
    recorder = Recorder(scripts)
    assert [d.id for d in await deliveries.claim(b, lease_ms=30_000)] == ["msg_3"]
    lease = await redis.zscore(qs.keys.deliveries_due(b), "msg_3")

    again = await recorder.rerun_last()

    assert (again.code, again.value) == (Code.APPLIED, "msg_3")
    assert await redis.zscore(qs.keys.deliveries_due(b), "msg_3") == lease  # not leased twice
    assert await deliveries.claim(b, lease_ms=30_000) == []  # another claim: the lease holds
    assert (await recorder.rerun_last()).code is Code.PENDING  # that one claimed nothing


async def test_webhook_add_rerun_that_filled_the_cap_reports_the_registration_not_full(
    store: tuple[Redis, Scripts, QuestionStore], redis: Redis
) -> None:
    """The first run registered the owner's last allowed endpoint; its re-run must not say
    `full` (the caller would report a 409 for a webhook that exists)."""
    _, scripts, qs = store
    registry = WebhookRegistry(redis, scripts, qs.keys, OutboundPolicy())
    for _ in range(MAX_PER_OWNER - 1):
        await registry.create("deploybot", "https://example.com/hook", ["question.answered"])
    recorder = Recorder(scripts)
    last = await registry.create("deploybot", "https://example.com/last", ["question.answered"])
    before = await snapshot(redis, qs.keys.prefix)

    again = await recorder.rerun_last()

    assert (again.code, again.value) == (Code.APPLIED, str(last.created_ms))
    assert await snapshot(redis, qs.keys.prefix) == before
