"""Fault injection on the service side: lost Redis replies, a slow subscribe, killed pub/sub
connections, many sweepers at once, and an instance killed with SIGKILL mid-work.

Each test's docstring states the invariant it checks. Every test runs against a Redis of its own
(tests/chaos/conftest.py), so killing clients or connections there touches no other test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from bench.procs import ADMIN_TOKEN as BENCH_ADMIN_TOKEN
from bench.procs import Proc, ServiceProc
from service.events import GROUP
from service.http.appkeys import WAITERS
from service.keys import BUCKETS, Keys
from service.scripts import Code, LuaScript
from service.settings import Settings
from service.store import QuestionStore
from service.sweeper import KeyspaceListener, Sweeper
from tests.api import Api
from tests.chaos.conftest import Processes
from tests.chaos.proxy import Action, Proxy, Rule
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_contract import within
from tests.helpers_reliability import (
    ChannelTap,
    eventually,
    new_question,
    open_store,
    outbox_events,
    question_hash,
    redis_ms,
    stats_totals,
)
from tests.redis_server import RedisServer

ANSWER_SHA = LuaScript.load("answer").sha.encode()
CANCEL_SHA = LuaScript.load("cancel").sha.encode()


@dataclass
class Scene:
    """One in-process service instance (through `redis_url`), its principals, and a direct
    Redis client for reading the truth behind the API."""

    api: Api
    redis: Redis
    settings: Settings
    agent: str
    alice: str

    @property
    def keys(self) -> Keys:
        return Keys(self.settings.key_prefix)

    async def ask(self, expires_in: float = 600) -> str:
        body = await self.api.ask(self.agent, {"user": "alice"}, expires_in=expires_in)
        question_id: str = body["id"]
        return question_id


@contextlib.asynccontextmanager
async def scene(
    truth_url: str, service_url: str, *, like: Scene | None = None, **changes: Any
) -> AsyncIterator[Scene]:
    """`like`: a second instance over the same keys and principals as that scene."""
    if like is not None:
        changes["key_prefix"] = like.settings.key_prefix
    settings = settings_for(service_url, **changes)
    client = await start_client(settings)
    redis = Redis.from_url(truth_url, decode_responses=True)
    try:
        api = Api(client, ADMIN_TOKEN)
        if like is None:
            agent = await api.principal("deploybot", "agent")
            alice = await api.principal("alice", "user")
        else:
            agent, alice = like.agent, like.alice
        yield Scene(api, redis, settings, agent, alice)
    finally:
        await close_client(client)
        await redis.aclose()


async def transition_story(s: Scene, question_id: str) -> tuple[Counter[str], list[str], dict[str, str]]:
    """(stats counters, outbox event types about this question, the stored hash)."""
    events = [
        e["type"] for e in await outbox_events(s.redis, s.settings.key_prefix) if e["id"] == question_id
    ]
    stored = await question_hash(s.redis, s.settings.key_prefix, question_id)
    return await stats_totals(s.redis, s.settings.key_prefix), events, stored


# -- fault 9: a reply lost after the script ran -------------------------------------------------


TAPS = {
    # route -> (script SHA in the request, body, principal attribute, terminal state)
    "answer": (ANSWER_SHA, {"option": "yes"}, "alice", "answered"),
    "cancel": (CANCEL_SHA, {"reason": "lost reply"}, "agent", "cancelled"),
}


@pytest.mark.parametrize("action", [Action.LOSE_REPLY, Action.RESET_AFTER_REPLY])
@pytest.mark.parametrize("route", list(TAPS))
async def test_a_lost_script_reply_is_retried_with_its_call_id_and_applies_once(
    own_redis: RedisServer, proxy: Proxy, route: str, action: Action
) -> None:
    """Invariant: when Redis ran the transition but its reply never reached the service (silence
    until the socket timeout, or a reset), redis-py's retry re-runs the same call id and the HTTP
    caller gets the first run's outcome (applied: true); there is exactly one transition, one
    outbox event and one publish."""
    async with scene(own_redis.url, proxy.url, redis_timeout_seconds=0.5) as s:
        question_id = await s.ask()
        sha, body, who, state = TAPS[route]
        rule = proxy.add(Rule(sha, action, times=1, also=question_id.encode()))
        channel = s.keys.for_question(question_id).channel
        async with ChannelTap(s.redis, [channel]) as tap:
            reply = await s.api.call("POST", f"/v1/questions/{question_id}/{route}", getattr(s, who), body)
            published = await tap.drain()
        assert rule.fired.is_set(), "the fault was not injected"
        assert rule.hits == 1
        assert reply.status == 200, reply.body
        assert reply.body["applied"] is True
        assert reply.body["question"]["state"] == state
        stats, events, stored = await transition_story(s, question_id)
        assert stats[state] == 1
        assert stats["stale"] == 0
        assert events == ["question.created", f"question.{state}"]
        assert len(published) == 1
        assert stored["version"] == "2"
        fetched = await s.api.get(s.agent, question_id)
        assert fetched.body == reply.body["question"]


async def test_an_answer_whose_every_reply_is_lost_fails_and_its_http_retry_reports_the_same_story(
    own_redis: RedisServer, proxy: Proxy
) -> None:
    """Invariant: when every attempt's reply is lost, the caller gets a 503 problem, not a 500;
    the script ran once and its re-runs (same call id) changed nothing. An HTTP-level retry sent
    without an Idempotency-Key (as here) is a new call: it reports applied: false with the very
    envelope the first call would have
    returned (same option, same responder, same timestamps). Still one transition, one outbox
    event, one publish; the retry counts one stale tap."""
    async with scene(own_redis.url, proxy.url, redis_timeout_seconds=0.3) as s:
        question_id = await s.ask()
        rule = proxy.add(Rule(ANSWER_SHA, Action.LOSE_REPLY, times=None, also=question_id.encode()))
        channel = s.keys.for_question(question_id).channel
        async with ChannelTap(s.redis, [channel]) as tap:
            first = await s.api.answer(s.alice, question_id, "yes")
            rule.times = rule.hits  # the network heals
            retried = await s.api.answer(s.alice, question_id, "yes")
            published = await tap.drain()
        assert rule.hits == 3, "one attempt and redis-py's two retries, each reply lost"
        assert first.status == 503, first.body
        assert first.body["status"] == 503
        assert retried.status == 200, retried.body
        assert retried.body["applied"] is False
        story = retried.body["question"]
        assert story["state"] == "answered"
        assert story["answer"]["option"] == "yes"
        assert story["answer"]["responder"] == "alice"
        stats, events, stored = await transition_story(s, question_id)
        assert (stats["answered"], stats["stale"]) == (1, 1)
        assert events == ["question.created", "question.answered"]
        assert len(published) == 1
        assert stored["version"] == "2"
        # The first call's own reply, as it would have been, is what the re-run returns.
        assert json.loads(published[0][1])[1::2] == list(stored.values())
        assert (await s.api.get(s.agent, question_id)).body == story


# -- fault 10: the subscribe / commit race ------------------------------------------------------


@pytest.mark.parametrize("action", [Action.HOLD_REQUEST, Action.HOLD_REPLY])
async def test_a_waiter_whose_subscribe_is_delayed_still_returns_an_answer_made_meanwhile_at_once(
    own_redis: RedisServer, proxy: Proxy, action: Action
) -> None:
    """Invariant: an answer committed while a waiter's SUBSCRIBE is on its way (held before it
    reaches Redis, so the publish reaches nobody) or while its confirmation is on its way back
    (held after Redis subscribed) still wakes the waiter at once after the confirmation: the
    waiter reads the question after subscribing. Not at its 60 s timeout (the guard is 15 s)."""
    async with (
        scene(own_redis.url, proxy.url, wait_max_seconds=60) as s,
        scene(own_redis.url, own_redis.url, like=s) as other,
    ):
        question_id = await s.ask()
        rule = proxy.add(Rule(b"SUBSCRIBE", action, also=question_id.encode()))
        waiting = asyncio.create_task(s.api.wait(s.agent, question_id, 60))
        await within(10, rule.fired.wait(), "the waiter's SUBSCRIBE")
        answered = await other.api.answer(s.alice, question_id, "no")
        assert answered.body["applied"] is True
        rule.release()
        reply = await within(15, waiting, "the waiter")
        assert reply.status == 200
        assert reply.body == answered.body["question"]


# -- fault 4: pub/sub and keyspace connections killed while deadlines pass ----------------------


# redis-py (8.1) can leak the socket of a pub/sub connection that two coroutines reconnect at
# once (the reader and a command); the collector then reports it. Invariants are checked below.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_killed_pubsub_connections_still_let_deadlines_expire_and_waiters_wake(
    own_redis: RedisServer,
) -> None:
    """Invariant: with every pub/sub connection (the waiters' and the keyspace listener's) killed
    over and over by CLIENT KILL TYPE pubsub while the deadlines pass, every question still
    expires exactly once (the sweeper enforces) and every parked waiter still returns the
    expired envelope, long before its 60 s timeout (guard: 20 s), through the re-read that
    follows redis-py's resubscribe."""
    count = 20
    async with scene(own_redis.url, own_redis.url, wait_max_seconds=60) as s:
        ids = [await s.ask(expires_in=2) for _ in range(count)]
        deadline_ms = int((await question_hash(s.redis, s.settings.key_prefix, ids[-1]))["expires_ms"])
        waits = [asyncio.create_task(s.api.wait(s.agent, q, 60)) for q in ids]
        waiters = s.api.client.app[WAITERS]  # type: ignore[union-attr]
        await eventually(lambda: _true(waiters.waiting == count), within=10, what="waiters parked")

        async def all_subscribed() -> bool:
            counts = await s.redis.pubsub_numsub(*(s.keys.for_question(q).channel for q in ids))
            return all(n == 1 for _, n in counts)

        await eventually(all_subscribed, within=10, what="waiters subscribed")
        killed = []
        while await redis_ms(s.redis) < deadline_ms + 1000:
            killed.append(int(await s.redis.execute_command("CLIENT KILL TYPE pubsub")))
            await asyncio.sleep(0.1)
        replies = await within(20, asyncio.gather(*waits), "the waiters")
        assert killed[0] >= 2, "the waiters' and the listener's connections were both killed"
        assert sum(killed) > len(killed), "connections came back and were killed again"
        assert waiters.resubscriptions >= 1
        assert [r.status for r in replies] == [200] * count
        assert {r.body["state"] for r in replies} == {"expired"}
        stats = await stats_totals(s.redis, s.settings.key_prefix)
        assert stats["expired"] == count
        events = await outbox_events(s.redis, s.settings.key_prefix)
        assert Counter(e["id"] for e in events if e["type"] == "question.expired") == Counter(ids)
        for question_id, reply in zip(ids, replies, strict=True):
            assert (await s.api.get(s.agent, question_id)).body == reply.body


async def _true(value: bool) -> bool:
    return value


# -- fault 6: three sweepers and two keyspace listeners over 10k overdue questions -------------

MANY = 10_000


async def create_many(store: QuestionStore, count: int, expires_in_ms: int) -> list[str]:
    """`count` questions, each due `expires_in_ms` after its creation, created through
    create.lua in batches."""
    ids: list[str] = []
    for start in range(0, count, 1000):
        batch = [new_question(expires_in_ms=expires_in_ms) for _ in range(start, min(count, start + 1000))]
        replies = await asyncio.gather(*(store.create(q, None) for q in batch))
        assert {r.code for r in replies} == {Code.CREATED}
        ids.extend(r.fields["id"] for r in replies if r.fields is not None)
    return ids


def sweeper_process(workdir: Path, settings: Settings) -> Proc:
    env = {
        "QS_REDIS_URL": settings.redis_url,
        "QS_KEY_PREFIX": settings.key_prefix,
        "QS_SWEEP_BATCH": str(settings.sweep_batch),
        "QS_SWEEP_INTERVAL_SECONDS": str(settings.sweep_interval_seconds),
        "QS_LOG_LEVEL": "WARNING",
    }
    args = [sys.executable, "-m", "service", "sweep"]
    return Proc("sweeper", args, {**os.environ, **env}, workdir)


async def states_of(redis: Redis, keys: Keys, ids: Sequence[str]) -> Counter[str]:
    async with redis.pipeline(transaction=False) as pipe:
        for question_id in ids:
            pipe.hget(keys.for_question(question_id).question, "state")
        return Counter(await pipe.execute())


async def test_three_sweepers_and_two_listeners_expire_each_of_10k_questions_exactly_once(
    own_redis: RedisServer, processes: Processes
) -> None:
    """Invariant: three sweepers (two in this process, one `python -m service sweep`) and two
    keyspace listeners, all racing over the same 10,000 questions as they pass their deadlines,
    expire each question exactly once: the stats hashes count exactly 10,000 expiries, the
    outboxes hold exactly one question.expired event per question, every question is expired,
    and the in-process sweepers and listeners together applied no more than 10,000."""
    settings = settings_for(own_redis.url, sweep_batch=100, sweep_interval_seconds=0.05)
    keys = Keys(settings.key_prefix)
    processes.start(sweeper_process(processes.workdir, settings))
    stores = [open_store(settings) for _ in range(4)]
    redis, _, store = stores[0]
    sweepers = [Sweeper(stores[i][2], settings.sweep_interval_seconds) for i in (0, 1)]
    listeners = [KeyspaceListener(stores[i][0], stores[i][2], keys) for i in (2, 3)]
    tasks = [asyncio.create_task(job.run()) for job in (*sweepers, *listeners)]
    try:
        ids = await create_many(store, MANY, 2000)

        async def all_expired() -> bool:
            return (await stats_totals(redis, settings.key_prefix))["expired"] >= MANY

        await eventually(all_expired, within=60, every=0.2, what="10k expiries")
        # Let every racer take at least one more pass over what is left.
        passes = [s.totals.passes for s in sweepers]
        await eventually(
            lambda: _true(all(s.totals.passes > p + 1 for s, p in zip(sweepers, passes, strict=True))),
            within=10,
            what="two more sweeps",
        )
    finally:
        for job in (*sweepers, *listeners):
            job.stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    try:
        assert processes.started[0].alive(), processes.started[0].log_tail()
        stats = await stats_totals(redis, settings.key_prefix)
        assert stats["expired"] == MANY
        events = await outbox_events(redis, settings.key_prefix)
        expired = Counter(e["id"] for e in events if e["type"] == "question.expired")
        assert len(expired) == MANY
        assert set(expired.values()) == {1}
        assert set(expired) == set(ids)
        assert await states_of(redis, keys, ids) == Counter({"expired": MANY})
        in_process = sum(s.totals.expired for s in sweepers) + sum(li.expired for li in listeners)
        assert in_process <= MANY
        print(
            f"\nfault 6: in-process sweepers expired {[s.totals.expired for s in sweepers]}, "
            f"listeners {[li.expired for li in listeners]}, the subprocess {MANY - in_process}"
        )
    finally:
        for client, scripts, _ in stores:
            await scripts.aclose()
            await client.aclose()


# -- fault 3: an instance killed with SIGKILL mid-work ------------------------------------------

OVERDUE, PARKED = 600, 20


@dataclass
class Client:
    """HTTP calls to whichever instance is given, as the bench's admin or a principal."""

    session: Any
    tokens: dict[str, str]

    async def call(self, base: str, method: str, path: str, who: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.tokens[who]}"}
        async with self.session.request(method, base + path, json=body, headers=headers) as response:
            return response.status, await response.json(content_type=None)

    async def ask(self, base: str, expires_in: int) -> str:
        body = {
            "prompt": "Proceed?",
            "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
            "to": {"user": "alice"},
            "expires_in": expires_in,
        }
        status, created = await self.call(base, "POST", "/v1/questions", "agent", body)
        assert status == 201, created
        question_id: str = created["id"]
        return question_id


async def wait_with_failover(client: Client, bases: Sequence[str], question_id: str) -> tuple[int, Any]:
    """A long poll that, when its instance dies under it, retries on the next instance, as a
    client behind a load balancer would (retrying while that instance is still starting)."""
    path = f"/v1/questions/{question_id}/wait?timeout=60"
    for base in bases[:-1]:
        with contextlib.suppress(aiohttp.ClientError):
            return await client.call(base, "GET", path, "agent")
    give_up = asyncio.get_running_loop().time() + 30
    while True:
        try:
            return await client.call(bases[-1], "GET", path, "agent")
        except aiohttp.ClientConnectorError:
            if asyncio.get_running_loop().time() > give_up:
                raise
            await asyncio.sleep(0.1)  # the instance is not listening yet


async def relay_backlog(redis: Redis, keys: Keys) -> tuple[int, int]:
    """(entries delivered to a relay but not acknowledged, entries not yet delivered) over the
    16 outboxes, for the relay's consumer group."""
    pending = undelivered = 0
    for b in range(BUCKETS):
        info = await redis.xinfo_stream(keys.outbox(b))
        for group in await redis.xinfo_groups(keys.outbox(b)):
            if group["name"] == GROUP:
                pending += int(group["pending"])
                undelivered += group["last-delivered-id"] != info["last-generated-id"]
    return pending, undelivered


async def held_entries(redis: Redis, keys: Keys) -> list[tuple[str, str]]:
    """(outbox, entry id) of every entry delivered to a relay and not acknowledged."""
    held = []
    for b in range(BUCKETS):
        outbox = keys.outbox(b)
        for entry in await redis.xpending_range(outbox, GROUP, min="-", max="+", count=1000):
            held.append((outbox, str(entry["message_id"])))
    return held


async def event_refs(redis: Redis, keys: Keys) -> dict[str, set[str]]:
    """The outbox entries (as `<outbox>/<entry id>`) each principal's event stream holds."""
    refs: dict[str, set[str]] = {}
    for principal in ("alice", "deploybot"):
        entries = await redis.xrange(keys.events(principal))
        refs[principal] = {fields["outbox"] for _, fields in entries}
    return refs


async def assert_every_event_relayed(redis: Redis, keys: Keys) -> int:
    """Every outbox entry is in the event stream of everyone it concerns (the target for a
    created question; the asker and the target for a resolved one). Returns the entry count."""
    streams = await event_refs(redis, keys)
    count = 0
    for b in range(BUCKETS):
        outbox = keys.outbox(b)
        for entry_id, fields in await redis.xrange(outbox):
            ref = f"{outbox}/{entry_id}"
            assert ref in streams["alice"], f"{fields['type']} {ref} never reached alice"
            if fields["type"] != "question.created":
                assert ref in streams["deploybot"], f"{fields['type']} {ref} never reached the asker"
            count += 1
    return count


@dataclass
class Failover:
    """Instance A (behind the proxy) and instance B (direct), one Redis, and the test's view."""

    a: ServiceProc
    b: ServiceProc
    client: Client
    redis: Redis
    proxy: Proxy
    processes: Processes
    keys: Keys = field(default_factory=lambda: Keys("qs"))
    parked: list[str] = field(default_factory=list)  # long deadlines: answered or cancelled on B
    parked_short: list[str] = field(default_factory=list)  # expire while their waiter fails over
    overdue: list[str] = field(default_factory=list)  # A's sweeper is killed part-way through these

    async def principals(self) -> None:
        for name, kind in (("deploybot", "agent"), ("alice", "user")):
            status, made = await self.client.call(
                self.a.url, "POST", "/v1/admin/principals", "admin", {"id": name, "kind": kind}
            )
            assert status == 201, made
            self.client.tokens["agent" if kind == "agent" else name] = made["token"]

    async def park_waiters_on_a(self) -> list[asyncio.Task[tuple[int, Any]]]:
        self.parked = [await self.client.ask(self.a.url, 600) for _ in range(PARKED)]
        self.parked_short = [await self.client.ask(self.a.url, 8) for _ in range(4)]
        bases = [self.a.url, self.b.url]
        waits = [
            asyncio.create_task(wait_with_failover(self.client, bases, q))
            for q in self.parked + self.parked_short
        ]

        async def all_parked() -> bool:
            channels = (self.keys.for_question(q).channel for q in self.parked)
            return all(n == 1 for _, n in await self.redis.pubsub_numsub(*channels))

        await eventually(all_parked, within=15, what="A's waiters subscribed")
        return waits

    async def kill_a_mid_sweep(self) -> tuple[int, list[tuple[str, str]]]:
        """SIGKILL A once its (slowed) sweeper has expired some of the overdue questions.
        Returns how many it had expired and the outbox entries its relay held."""
        self.overdue = list(await asyncio.gather(*(self.client.ask(self.a.url, 5) for _ in range(OVERDUE))))
        self.proxy.latency = 0.02  # each sweep round of A (4 round trips, 32 expiries) takes > 80 ms

        async def mid_sweep() -> bool:
            return (await stats_totals(self.redis, "qs"))["expired"] >= 64

        await eventually(mid_sweep, within=20, every=0.005, what="A's sweeper two rounds in")
        assert self.a.process is not None
        self.a.process.kill()
        self.a.process.wait()
        return (await stats_totals(self.redis, "qs"))["expired"], await held_entries(self.redis, self.keys)

    async def resolve_parked_on_b(self) -> dict[str, Any]:
        """Half answered by alice, half cancelled by the agent, all through B: their envelopes."""
        outcomes = {}
        for i, question_id in enumerate(self.parked):
            who, route = ("alice", "answer") if i % 2 else ("agent", "cancel")
            body = {"option": "yes"} if route == "answer" else {"reason": "failover"}
            path = f"/v1/questions/{question_id}/{route}"
            status, outcome = await self.client.call(self.b.url, "POST", path, who, body)
            assert status == 200, outcome
            assert outcome["applied"] is True
            outcomes[question_id] = outcome["question"]
        return outcomes

    async def assert_nothing_pending_past_its_deadline(self) -> None:
        async def nothing_overdue() -> bool:
            now = await redis_ms(self.redis)
            for b in range(BUCKETS):
                deadlines = self.keys.deadlines(b)
                if await self.redis.zrange(deadlines, "-inf", now, byscore=True, offset=0, num=1):
                    return False
            return True

        await eventually(nothing_overdue, within=15, what="B's sweeper catching up")
        now = await redis_ms(self.redis)
        for question_id in [*self.parked, *self.parked_short, *self.overdue]:
            key = self.keys.for_question(question_id).question
            state, expires_ms = await self.redis.hmget(key, "state", "expires_ms")
            assert state != "pending" or int(expires_ms) > now, f"{question_id} pending past its deadline"
        assert await states_of(self.redis, self.keys, self.overdue) == Counter({"expired": OVERDUE})


async def test_an_instance_killed_mid_work_loses_no_wait_no_deadline_and_no_event(
    own_redis: RedisServer, own_redis_client: Redis, proxy: Proxy, processes: Processes
) -> None:
    """Invariant: instance A is SIGKILLed while it holds parked long polls, while its sweeper is
    part-way through expiring 600 overdue questions (some expired, some not: the proxy slows A so
    a sweep takes many rounds), and while its event relay holds outbox entries it read but never
    acknowledged (the proxy swallows A's XACK). Then: instance B serves the retried waits with
    the terminal envelope; no question stays pending past its deadline; every outbox event
    (each creation and each transition) reaches the per-principal streams once a surviving
    relay (B's, with its default 30 s idle threshold) has XAUTOCLAIMed A's pending entries."""
    slow_sweeps = {"sweep_batch": "2", "sweep_interval_seconds": "0.2", "redis_timeout_seconds": "30"}
    a = ServiceProc(processes.subdir("a"), proxy.url, name="a", keyspace_notifications="false", **slow_sweeps)
    b = ServiceProc(processes.subdir("b"), own_redis.url, name="b")
    await processes.start_async(a)
    # A's relay reads the parked questions' creations as one batch (its read waits in the proxy
    # until they all exist), relays them, and its XACK never arrives: it holds the whole batch.
    # (Matched on the group name: other consumer groups, such as webhook delivery, read too.)
    relay_group = f"${len(GROUP)}\r\n{GROUP}\r\n".encode()
    hold_read = proxy.add(Rule(b"XREADGROUP", Action.HOLD_REQUEST, also=relay_group))
    swallow_acks = proxy.add(Rule(b"XACK", Action.SWALLOW, times=None, also=relay_group))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = Client(session, {"admin": BENCH_ADMIN_TOKEN})
        f = Failover(a, b, client, own_redis_client, proxy, processes)
        await f.principals()
        await within(15, hold_read.fired.wait(), "A's relay reading")
        waits = await f.park_waiters_on_a()
        try:
            hold_read.release()
            await within(15, swallow_acks.fired.wait(), "A's relay acknowledging")
            expired_at_kill, held_at_kill = await f.kill_a_mid_sweep()
            assert 0 < expired_at_kill < OVERDUE, "A died part-way through its sweep"
            assert len(held_at_kill) == PARKED + 4, "A died holding its relay's whole batch"

            await processes.start_async(b)
            outcomes = await f.resolve_parked_on_b()
            replies = await within(30, asyncio.gather(*waits), "the retried waits")
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
    for question_id, (status, envelope) in zip(f.parked + f.parked_short, replies, strict=True):
        assert status == 200, envelope
        if question_id in outcomes:
            assert envelope == outcomes[question_id]
        else:
            assert envelope["state"] == "expired"
    await f.assert_nothing_pending_past_its_deadline()

    async def relayed_everything() -> bool:
        pending, undelivered = await relay_backlog(f.redis, f.keys)
        return pending == 0 and undelivered == 0

    # B's relay XAUTOCLAIMs entries idle for 30 s (RECLAIM_IDLE_MS), checking every 10 s.
    await eventually(relayed_everything, within=60, every=0.5, what="B's relay reclaiming A's entries")
    refs = await event_refs(f.redis, f.keys)
    for outbox, entry_id in held_at_kill:
        assert f"{outbox}/{entry_id}" in refs["alice"], "an entry A held never reached its stream"
    events = await assert_every_event_relayed(f.redis, f.keys)
    total = len(f.parked) + len(f.parked_short) + OVERDUE
    assert events == 2 * total, "one created and one terminal event per question"
    print(
        f"\nfault 3: A killed with {expired_at_kill}/{OVERDUE} expired and {len(held_at_kill)} "
        f"relay entries unacknowledged; B relayed all {events} outbox entries"
    )
