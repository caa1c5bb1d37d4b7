"""Fault injection on the Redis side: a restart (SIGKILL, `appendfsync always`), a restart that
is still loading its data, a SIGKILL under `appendfsync everysec`, a paused server, and a
pub/sub connection dropped for overrunning its output buffer. (Clock skew: test_clock_skew.py.)

Each test runs its own redis-server (never 6379) and the service in-process, drives a bounded
mixed load through real HTTP, injects one fault, and then checks the invariants named in its
docstring against the HTTP replies the load saw (the *ledger*: what the service acknowledged) and
against Redis itself (`assert_consistent`: every question has one coherent story).

The measured figures are printed as `chaos figure ...` lines: run with `-rP` (or `-s`) to see them.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.http.appkeys import STORE, WAITERS
from service.keys import BUCKETS, Keys, bucket_of
from service.redis_client import RETRIES
from service.scripts import Code, Fields, LuaScript, Reply, Scripts, pairs_to_fields
from service.settings import Settings
from service.store import QuestionStore, new_call_id
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import ask_body, eventually, redis_ms, stats_totals
from tests.redis_server import RedisServer

TERMINAL = ("answered", "expired", "cancelled")
CREATION_FIELDS = ("id", "asker", "to_kind", "to_id", "prompt", "options", "opt_ids", "meta")
REQUIRED_FIELDS = (*CREATION_FIELDS, "state", "created_ms", "expires_ms", "version", "ccall")
TRANSITION_FIELDS = ("resolved_ms", "tcall", "ans_option", "ans_by", "ans_ms", "cancel_by", "cancel_reason")
IMMUTABLE_ENVELOPE = ("id", "prompt", "options", "to", "asker", "created_at", "expires_at", "metadata")
GRACE = 2.0  # seconds a reply may take beyond its own budget before it counts as a hang
WORKERS = 8
OPS_PER_WORKER = 2000  # bounds the load even if a stop signal were never given


def figure(name: str, **values: object) -> None:
    """One measured figure, for the report (visible with -rP or -s)."""
    print(f"chaos figure {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


# -- the load and its ledger -----------------------------------------------------------------------


@dataclass
class Seen:
    """One HTTP exchange as a client saw it. status 0: no reply within the budget (a hang)."""

    method: str
    path: str
    status: int
    body: Any
    headers: Mapping[str, str]
    started: float
    elapsed: float


@dataclass
class Ledger:
    """What the service acknowledged, when, and every reply that breaks the outage contract."""

    created: dict[str, dict[str, Any]] = field(default_factory=dict)
    resolved: dict[str, dict[str, Any]] = field(default_factory=dict)
    acked_at: dict[tuple[str, str], float] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    unacceptable: list[str] = field(default_factory=list)
    slowest: float = 0.0

    def judge(self, seen: Seen) -> Seen:
        """A reply is a success, or a 503 problem+json with Retry-After; nothing else."""
        self.statuses[seen.status] += 1
        self.slowest = max(self.slowest, seen.elapsed)
        if seen.status in (200, 201):
            return seen
        what = f"{seen.method} {seen.path} -> {seen.status} after {seen.elapsed:.2f} s: {seen.body!r:.300}"
        if seen.status != 503:
            self.unacceptable.append(what)
        elif not (
            seen.headers.get("Content-Type", "").startswith("application/problem+json")
            and isinstance(seen.body, dict)
            and seen.body.get("status") == 503
            and str(seen.body.get("type", "")).endswith("/unavailable")
            and seen.headers.get("Retry-After", "").isdigit()
        ):
            self.unacceptable.append("not a proper 503 problem with Retry-After: " + what)
        return seen

    def ack_create(self, seen: Seen) -> None:
        question_id = seen.body["id"]
        self.created[question_id] = seen.body
        self.acked_at["create", question_id] = seen.started + seen.elapsed

    def ack_transition(self, seen: Seen) -> None:
        if seen.status == 200 and seen.body["applied"]:
            question = seen.body["question"]
            self.resolved[question["id"]] = question
            self.acked_at["transition", question["id"]] = seen.started + seen.elapsed


class Caller:
    """JSON calls to the in-process service with a hard per-request budget; every reply judged."""

    def __init__(
        self, session: aiohttp.ClientSession, url: Callable[[str], Any], budget: float, ledger: Ledger
    ) -> None:
        self.session = session
        self.url = url
        self.budget = budget
        self.ledger = ledger
        self.tasks: list[asyncio.Task[Seen]] = []

    def waits(self, token: str, ids: list[str], timeout: float) -> list[asyncio.Task[Seen]]:
        """Long-polls in the background; `service()` cancels whatever is left on the way out."""
        tasks = [asyncio.create_task(self.wait(token, q, timeout)) for q in ids]
        self.tasks.extend(tasks)
        return tasks

    async def cancel_leftovers(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def call(
        self, method: str, path: str, token: str | None = None, body: Any = None, *, wait: float = 0.0
    ) -> Seen:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        started = time.monotonic()
        try:
            async with asyncio.timeout(wait + self.budget):
                async with self.session.request(
                    method, self.url(path), data=data, headers=headers
                ) as response:
                    payload = await response.read()
                    json_reply = payload and response.content_type.endswith("json")
                    decoded = json.loads(payload) if json_reply else payload.decode(errors="replace")
                    seen = Seen(method, path, response.status, decoded, dict(response.headers), started, 0.0)
        except TimeoutError:
            seen = Seen(method, path, 0, "no reply within the budget", {}, started, 0.0)
        seen.elapsed = time.monotonic() - started
        return self.ledger.judge(seen)

    async def ask(self, token: str, to: Mapping[str, str], **extra: Any) -> Seen:
        seen = await self.call("POST", "/v1/questions", token, ask_body(to, **extra))
        if seen.status == 201:
            self.ledger.ack_create(seen)
        return seen

    async def question(self, token: str, to: Mapping[str, str], **extra: Any) -> str:
        """A question the test sets up (the store is up): its id."""
        seen = await self.ask(token, to, **extra)
        assert seen.status == 201, f"setting up a question failed: {seen}"
        question_id: str = seen.body["id"]
        return question_id

    async def answer(self, token: str, question_id: str, option: str = "yes") -> Seen:
        path = f"/v1/questions/{question_id}/answer"
        seen = await self.call("POST", path, token, {"option": option})
        self.ledger.ack_transition(seen)
        return seen

    async def cancel(self, token: str, question_id: str) -> Seen:
        seen = await self.call("POST", f"/v1/questions/{question_id}/cancel", token, {"reason": "chaos"})
        self.ledger.ack_transition(seen)
        return seen

    async def get(self, token: str, question_id: str) -> Seen:
        return await self.call("GET", f"/v1/questions/{question_id}", token)

    async def wait(self, token: str, question_id: str, timeout: float) -> Seen:
        path = f"/v1/questions/{question_id}/wait?timeout={timeout:g}"
        return await self.call("GET", path, token, wait=timeout)


@dataclass
class Cast:
    agent: str
    alice: str


async def make_cast(api: Api) -> Cast:
    agent = await api.principal("agent", "agent")
    alice = await api.principal("alice", "user")
    await api.principal("bob", "user")
    await api.room("ops", ["alice", "bob"])
    return Cast(agent, alice)


async def worker(caller: Caller, cast: Cast, stop: asyncio.Event, seed: int) -> None:
    """Create, then answer, cancel, wait on, list or just read it: a bounded mixed load."""
    rng = random.Random(seed)
    for _ in range(OPS_PER_WORKER):
        if stop.is_set():
            return
        to = {"user": "alice"} if rng.random() < 0.7 else {"room": "ops"}
        created = await caller.ask(cast.agent, to)
        if created.status != 201:
            await asyncio.sleep(0.1)  # pacing while the store is down, not synchronisation
            continue
        question_id = created.body["id"]
        roll = rng.random()
        if roll < 0.4:
            await caller.answer(cast.alice, question_id, rng.choice(("yes", "no")))
        elif roll < 0.6:
            await caller.cancel(cast.agent, question_id)
        elif roll < 0.7:
            await caller.wait(cast.agent, question_id, 0.2)
        elif roll < 0.8:
            await caller.call("GET", "/v1/questions?role=asker&limit=5", cast.agent)
        else:
            await caller.get(cast.alice, question_id)


@asynccontextmanager
async def running_load(caller: Caller, cast: Cast, workers: int = WORKERS) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker(caller, cast, stop, seed)) for seed in range(workers)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def budget(settings: Settings) -> float:
    """Longest a request may take beyond its own long-poll timeout: one Redis call using up
    every attempt (the configured socket timeout each, backoff <= 0.5 s between them), after
    which the request ends in 503, plus a grace. A paused Redis stalls the calls of one request
    for no longer than the pause in total."""
    return (RETRIES + 1) * (settings.redis_timeout_seconds + 0.5) + GRACE


@asynccontextmanager
async def service(
    server: RedisServer, **changes: object
) -> AsyncIterator[tuple[TestClient[object, object], Api, Caller, Settings]]:
    """The service in-process over `server`, with a judging caller on an unbounded session."""
    settings = settings_for(server.url, **changes)
    client = await start_client(settings)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    caller = Caller(session, client.make_url, budget(settings), Ledger())
    try:
        yield client, Api(client, ADMIN_TOKEN), caller, settings
    finally:
        await caller.cancel_leftovers()
        await session.close()
        await close_client(client)


@asynccontextmanager
async def redis_server(*extra: str) -> AsyncIterator[RedisServer]:
    server = RedisServer(*extra).start()
    try:
        yield server
    finally:
        server.cleanup()


@asynccontextmanager
async def control(server: RedisServer) -> AsyncIterator[Redis]:
    """A test-side connection to the server, outside the service."""
    redis = Redis.from_url(server.url, decode_responses=True)
    try:
        yield redis
    finally:
        await redis.aclose()


# -- the truth in Redis ---------------------------------------------------------------------------


async def read_questions(redis: Redis, prefix: str) -> dict[str, Fields]:
    """Every question hash under the prefix, by the id in its key (a hash missing its own id
    field still shows up)."""
    names = [k async for k in redis.scan_iter(match=f"{prefix}:{{b*}}:q:*", count=1000)]
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(name)
        hashes = await pipe.execute()
    return {name.rsplit(":q:", 1)[1]: fields for name, fields in zip(names, hashes, strict=True)}


async def zsets(redis: Redis, names: list[str]) -> dict[str, dict[str, float]]:
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zrange(name, 0, -1, withscores=True)
        contents = await pipe.execute()
    return {name: dict(members) for name, members in zip(names, contents, strict=True)}


class Story:
    """Collects every way the keyspace contradicts itself."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def check(self, holds: bool, what: str) -> None:
        if not holds:
            self.problems.append(what)


async def assert_consistent(redis: Redis, settings: Settings) -> dict[str, Fields]:
    """Every question has exactly one coherent story, and nothing is half-written:

    - its hash has every creation field; a pending one has no terminal field, version 1, its
      deadline entry (score = expires_ms) and marker (unless Redis already expired it), no purge
      entry; a terminal one has version 2, the fields of its state, a purge entry (score = the
      moment its end was recorded + retention: resolved_ms + retention for an answer or cancel,
      between that and now + retention for an expiry), no deadline entry, no marker;
    - both its index entries exist (`<created_ms:13>:<id>` in the asker and target index);
    - the outbox holds exactly one `question.created` for it, and exactly one terminal event
      (carrying the stored fields) once it is terminal, none before;
    - the other way round: no deadline, purge, marker, index or outbox entry names a question
      whose hash is missing; and the bucket counters add up to the hashes.
    Returns the questions' fields by id."""
    prefix = settings.key_prefix
    keys = Keys(prefix)
    story = Story()
    questions = await read_questions(redis, prefix)
    now = await redis_ms(redis)
    retention_ms = settings.retention_seconds * 1000
    deadlines = await zsets(redis, [keys.deadlines(b) for b in range(BUCKETS)])
    purges = await zsets(redis, [keys.purge(b) for b in range(BUCKETS)])
    index_names = [k async for k in redis.scan_iter(match=f"{prefix}:{{b*}}:ix:*", count=1000)]
    indexes = await zsets(redis, index_names)
    markers = {
        k.rsplit(":ttl:", 1)[1]: await redis.get(k)
        async for k in redis.scan_iter(match=f"{prefix}:{{b*}}:ttl:*", count=1000)
    }
    events: dict[str, list[tuple[str, str]]] = {}
    for b in range(BUCKETS):
        for _, entry in await redis.xrange(keys.outbox(b)):
            events.setdefault(entry["id"], []).append((entry["type"], entry["question"]))

    for question_id, fields in questions.items():
        b = bucket_of(question_id)
        missing = [f for f in REQUIRED_FIELDS if f not in fields]
        story.check(not missing, f"{question_id}: half-written hash, missing {missing}")
        if missing:
            continue
        state = fields["state"]
        member = f"{int(fields['created_ms']):013d}:{question_id}"
        story.check(fields["id"] == question_id, f"{question_id}: hash names {fields['id']}")
        for index in (
            keys.asker_index(b, fields["asker"]),
            keys.target_index(b, fields["to_kind"], fields["to_id"]),
        ):
            story.check(member in indexes.get(index, {}), f"{question_id}: no entry in {index}")
        kinds = [kind for kind, _ in events.get(question_id, [])]
        story.check(kinds.count("question.created") == 1, f"{question_id}: created events {kinds}")
        finals = [(k, p) for k, p in events.get(question_id, []) if k != "question.created"]
        if state == "pending":
            story.check(fields["version"] == "1", f"{question_id}: pending at version {fields['version']}")
            extra = [f for f in TRANSITION_FIELDS if f in fields]
            story.check(not extra, f"{question_id}: pending with terminal fields {extra}")
            story.check(
                deadlines[keys.deadlines(b)].get(question_id) == float(fields["expires_ms"]),
                f"{question_id}: pending without its deadline entry",
            )
            story.check(question_id not in purges[keys.purge(b)], f"{question_id}: pending in purge")
            story.check(
                markers.get(question_id) == question_id or now >= int(fields["expires_ms"]),
                f"{question_id}: pending without its deadline marker",
            )
            story.check(not finals, f"{question_id}: pending with terminal events {finals}")
            continue
        story.check(state in TERMINAL, f"{question_id}: unknown state {state!r}")
        story.check(fields["version"] == "2", f"{question_id}: {state} at version {fields['version']}")
        story.check(
            "resolved_ms" in fields and "tcall" in fields, f"{question_id}: {state} without resolved_ms/tcall"
        )
        story.check(question_id not in deadlines[keys.deadlines(b)], f"{question_id}: {state} still due")
        story.check(question_id not in markers, f"{question_id}: {state} with a deadline marker")
        purge_at = purges[keys.purge(b)].get(question_id)
        earliest = float(int(fields.get("resolved_ms", "0")) + retention_ms)
        latest = earliest if state != "expired" else float(now + retention_ms)
        story.check(
            purge_at is not None and earliest <= purge_at <= latest,
            f"{question_id}: {state} without its purge entry (score {purge_at})",
        )
        answered = [f for f in ("ans_option", "ans_by", "ans_ms") if f in fields]
        cancelled = [f for f in ("cancel_by",) if f in fields]
        if state == "answered":
            story.check(len(answered) == 3 and not cancelled, f"{question_id}: answered fields {fields}")
            story.check(
                f"|{fields.get('ans_option')}|" in fields["opt_ids"], f"{question_id}: answer not an option"
            )
        elif state == "cancelled":
            story.check(bool(cancelled) and not answered, f"{question_id}: cancelled fields {fields}")
        else:
            story.check(not answered and not cancelled, f"{question_id}: expired fields {fields}")
            story.check(
                fields.get("resolved_ms") == fields["expires_ms"], f"{question_id}: expired off its deadline"
            )
        story.check(
            [k for k, _ in finals] == [f"question.{state}"], f"{question_id}: {state} with events {kinds}"
        )
        if len(finals) == 1:
            published = pairs_to_fields(json.loads(finals[0][1]))
            story.check(published == fields, f"{question_id}: outbox story differs from the hash")

    referenced = [
        *(m for z in deadlines.values() for m in z),
        *(m for z in purges.values() for m in z),
        *markers,
        *events,
        *(m.split(":", 1)[1] for z in indexes.values() for m in z),
    ]
    orphans = sorted({question_id for question_id in referenced if question_id not in questions})
    story.check(not orphans, f"entries for questions without a hash: {orphans[:10]}")
    totals = await stats_totals(redis, prefix)
    states = Counter(fields.get("state") for fields in questions.values())
    story.check(totals["created"] == len(questions), f"created {totals['created']} != {len(questions)}")
    for state in TERMINAL:
        story.check(
            totals[state] == states[state], f"{state}: counted {totals[state]}, stored {states[state]}"
        )
    assert not story.problems, f"{len(story.problems)} inconsistencies:\n" + "\n".join(story.problems[:20])
    return questions


async def assert_acknowledged_present(caller: Caller, cast: Cast, ledger: Ledger) -> None:
    """Every 201 is still there with the same creation; every applied:true has the same terminal
    envelope, read back through the API."""
    semaphore = asyncio.Semaphore(32)

    async def fetch(question_id: str) -> Seen:
        async with semaphore:
            for _ in range(5):  # a 503 says "retry shortly", not "gone"
                reply = await caller.get(cast.agent, question_id)
                if reply.status != 503:
                    break
                await asyncio.sleep(0.2)
            return reply

    ids = list(ledger.created)
    replies = dict(zip(ids, await asyncio.gather(*(fetch(q) for q in ids)), strict=True))
    for question_id, created in ledger.created.items():
        reply = replies[question_id]
        assert reply.status == 200, f"acknowledged create {question_id} is gone: {reply}"
        for name in IMMUTABLE_ENVELOPE:
            assert reply.body[name] == created[name], f"{question_id}.{name} changed"
    for question_id, terminal in ledger.resolved.items():
        assert replies[question_id].body == terminal, f"acknowledged transition of {question_id} changed"


async def until_parked(
    client: TestClient[object, object], ids: list[str], tasks: list[asyncio.Task[Seen]]
) -> None:
    """Until every wait is registered and Redis has every channel subscribed, so no SUBSCRIBE
    is still in flight when the fault comes (the fault is the one each test names)."""
    app = client.server.app
    store = app[STORE]
    channels = [store.channel(q) for q in dict.fromkeys(ids)]

    async def parked() -> bool:
        returned = [t.result() for t in tasks if t.done()]
        assert not returned, f"a wait returned before anything happened: {returned[0]}"
        if app[WAITERS].waiting < len(tasks):
            return False
        counts = await store.redis.pubsub_numsub(*channels)
        return all(int(n) >= 1 for _, n in counts)

    await eventually(parked, within=20, what=f"{len(tasks)} waiters parked")


async def until_ready(caller: Caller) -> float:
    """Seconds until /readyz answers 200 again (polled; 503s in between are judged too)."""
    started = time.monotonic()

    async def ready() -> bool:
        return (await caller.call("GET", "/readyz")).status == 200

    await eventually(ready, within=30, every=0.05, what="/readyz recovers")
    return time.monotonic() - started


async def noscript_errors(redis: Redis) -> int:
    stats = await redis.info("errorstats")
    entry = stats.get("errorstat_NOSCRIPT", {"count": 0})
    return int(entry["count"])


# -- 1. restart with appendfsync always ------------------------------------------------------------


_PROBES = ("readyz", "create", "get", "list", "answer", "cancel", "wait", "wait-many", "admin")


async def _created_at_least(ledger: Ledger, count: int) -> bool:
    return len(ledger.created) >= count


async def _statuses_at_least(ledger: Ledger, status: int, count: int) -> bool:
    return ledger.statuses[status] >= count


async def probe_outage(caller: Caller, cast: Cast, pending_id: str) -> Counter[str]:
    """One request of every kind while Redis is down; returns 'route -> status' counts."""
    probes = {
        "readyz": caller.call("GET", "/readyz"),
        "create": caller.call("POST", "/v1/questions", cast.agent, ask_body({"user": "alice"})),
        "get": caller.get(cast.agent, pending_id),
        "list": caller.call("GET", "/v1/questions?role=asker", cast.agent),
        "answer": caller.answer(cast.alice, pending_id),
        "cancel": caller.cancel(cast.agent, pending_id),
        "wait": caller.wait(cast.agent, pending_id, 1),
        "wait-many": caller.call(
            "POST", "/v1/questions/wait", cast.agent, {"ids": [pending_id], "timeout": 1}
        ),
        "admin": caller.call("GET", "/v1/admin/rooms/ops", ADMIN_TOKEN),
    }
    seen = dict(zip(probes, await asyncio.gather(*probes.values()), strict=True))
    healthz = await caller.call("GET", "/healthz")
    assert healthz.status == 200, "liveness must not depend on Redis"
    return Counter({f"{name}={reply.status}": 1 for name, reply in seen.items()})


async def test_acknowledged_writes_survive_a_redis_restart_under_load_with_appendfsync_always() -> None:
    """Invariants: with `appendonly yes` + `appendfsync always`, a Redis killed (SIGKILL, the
    harshest restart) and started again on the same port under a mixed load loses nothing the
    service acknowledged: every 201 create and every applied:true transition reads back with the
    same envelope. While Redis is down every route answers 503 problem+json with Retry-After
    within the configured budget (no hang, no 500), /readyz is 503 and /healthz stays 200; both
    recover by themselves once Redis is back. Waiters parked before the outage are woken by
    answers given after it. The empty script cache of the new Redis (NOSCRIPT) is reloaded
    transparently, shown by SCRIPT FLUSH under load with every call still succeeding."""
    async with (
        redis_server("--appendonly", "yes", "--appendfsync", "always") as server,
        service(server, redis_timeout_seconds=2.0, wait_max_seconds=60) as (client, api, caller, settings),
    ):
        cast = await make_cast(api)
        parked_ids = [await caller.question(cast.agent, {"user": "alice"}) for _ in range(10)]
        parked = caller.waits(cast.agent, parked_ids, 40)
        await until_parked(client, parked_ids, parked)

        async with running_load(caller, cast):
            await eventually(lambda: _created_at_least(caller.ledger, 100), within=30, what="load")
            before_kill = len(caller.ledger.created), len(caller.ledger.resolved)
            server.kill()
            down_at = time.monotonic()
            outage = await probe_outage(caller, cast, parked_ids[0])
            await eventually(lambda: _statuses_at_least(caller.ledger, 503, 20), within=30, what="503s")
            server.start()
            up_at = time.monotonic()
            readyz_after_up = await until_ready(caller)
            async with control(server) as redis:
                noscript_on_restart = await noscript_errors(redis)
            more = len(caller.ledger.created) + 50
            await eventually(lambda: _created_at_least(caller.ledger, more), within=30, what="recovery")

        # Waiters parked before the outage, answered after it.
        answers = [await caller.answer(cast.alice, q) for q in parked_ids]
        assert all(a.status == 200 and a.body["applied"] for a in answers), answers
        woken = await asyncio.gather(*parked)
        for answer, wait in zip(answers, woken, strict=True):
            assert wait.status == 200, wait
            assert wait.body == answer.body["question"]

        async with control(server) as redis:
            await redis.config_resetstat()
            await redis.script_flush()
            more = len(caller.ledger.created) + 40
            async with running_load(caller, cast, workers=4):
                await eventually(lambda: _created_at_least(caller.ledger, more), within=30, what="load")
            assert await noscript_errors(redis) >= 1, "the flush was never noticed: the test proved nothing"

            assert caller.ledger.unacceptable == [], caller.ledger.unacceptable[:10]
            await assert_consistent(redis, settings)
        await assert_acknowledged_present(caller, cast, caller.ledger)

    figure(
        "restart(appendfsync always)",
        acknowledged_before_kill=before_kill,
        acknowledged_total=(len(caller.ledger.created), len(caller.ledger.resolved)),
        outage_probes=dict(sorted(outage.items())),
        statuses=dict(sorted(caller.ledger.statuses.items())),
        redis_down_s=f"{up_at - down_at:.2f}",
        readyz_200_after_redis_up_s=f"{readyz_after_up:.2f}",
        noscript_replies_after_restart=noscript_on_restart,
        slowest_reply_s=f"{caller.ledger.slowest:.2f}",
    )
    assert set(outage) == {f"{name}=503" for name in _PROBES}, outage


async def answers_loading(port: int) -> bool:
    """Whether the Redis on `port` accepts connections and answers PING with LOADING."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n")
        await writer.drain()
        return (await reader.readline()).startswith(b"-LOADING")
    finally:
        writer.close()
        await writer.wait_closed()


async def aof_rewritten(redis: Redis) -> bool:
    persistence = await redis.info("persistence")
    return not (persistence["aof_rewrite_in_progress"] or persistence["aof_rewrite_scheduled"])


async def test_a_restarted_redis_still_loading_its_data_gets_503s_then_everything_is_back() -> None:
    """Invariants: while a restarted Redis is still loading its data set (it answers LOADING;
    the load is slowed with the debug setting `key-load-delay`), every route answers 503
    problem+json with Retry-After within its budget, /readyz is 503 and /healthz 200; once
    loaded, the service recovers by itself and every acknowledged create and transition is back
    with its envelope, every question consistent."""
    async with (
        redis_server("--appendonly", "yes", "--appendfsync", "always") as server,
        service(server, redis_timeout_seconds=2.0) as (_, api, caller, settings),
    ):
        cast = await make_cast(api)
        async with running_load(caller, cast):
            await eventually(lambda: _created_at_least(caller.ledger, 300), within=60, what="load")
        pending = next(q for q in caller.ledger.created if q not in caller.ledger.resolved)
        async with control(server) as redis:
            # Into the RDB base of the AOF: key-load-delay only slows loading an RDB.
            await redis.bgrewriteaof()
            await eventually(lambda: aof_rewritten(redis), within=30, what="AOF rewrite")
        server.kill()
        # 5 ms per key, and serve clients (with LOADING) every KB loaded instead of every 2 MB.
        slow_load = ("--key-load-delay", "5000", "--loading-process-events-interval-bytes", "1024")
        server.extra = (*server.extra, *slow_load)
        restarted_at = time.monotonic()
        starting = asyncio.create_task(asyncio.to_thread(server.start))
        try:
            await eventually(lambda: answers_loading(server.port), within=10, what="LOADING")
            outage = await probe_outage(caller, cast, pending)
            still_loading = await answers_loading(server.port)
        finally:
            await starting
        loading_s = time.monotonic() - restarted_at
        readyz_after_loaded = await until_ready(caller)

        assert still_loading, "loading ended during the probes: they may have seen a plain outage"
        assert set(outage) == {f"{name}=503" for name in _PROBES}, outage
        assert caller.ledger.unacceptable == [], caller.ledger.unacceptable[:10]
        async with control(server) as redis:
            await assert_consistent(redis, settings)
        await assert_acknowledged_present(caller, cast, caller.ledger)
    figure(
        "restart-while-loading",
        questions=len(caller.ledger.created),
        outage_probes=dict(sorted(outage.items())),
        readyz_200_after_loaded_s=f"{readyz_after_loaded:.2f}",
        restart_to_loaded_s=f"{loading_s:.2f}",
    )


# -- 2. SIGKILL with appendfsync everysec ----------------------------------------------------------

LOSS_WINDOW = 2.0  # everysec: Redis documents up to ~1 s of writes at risk, 2 s when fsync lags


async def test_sigkill_under_appendfsync_everysec_loses_only_the_last_seconds_and_corrupts_nothing() -> None:
    """Invariants: with `appendfsync everysec`, a SIGKILL of Redis under a mixed load (no
    graceful shutdown) corrupts nothing: after the restart every surviving question has exactly
    one coherent story (`assert_consistent`: no hash without its index, deadline or outbox
    entries, nor the reverse; no half-applied transition), every surviving acknowledged
    transition has the acknowledged envelope, and any acknowledged create or transition that is
    missing was acknowledged within the last LOSS_WINDOW seconds before the kill. The number lost
    is reported (`chaos figure everysec-sigkill`): a process kill leaves the kernel's page cache,
    so Redis loses only what it had not yet write()n, normally nothing; a host crash would lose
    up to the last ~1 s that was written but not yet fsynced, which this test cannot simulate."""
    async with (
        redis_server("--appendonly", "yes", "--appendfsync", "everysec") as server,
        service(server, redis_timeout_seconds=2.0) as (_, api, caller, settings),
    ):
        cast = await make_cast(api)
        ledger = caller.ledger
        async with running_load(caller, cast):
            await eventually(lambda: _created_at_least(ledger, 500), within=60, what="load")
            killed_at = time.monotonic()
            server.kill()
            await eventually(lambda: _statuses_at_least(ledger, 503, 20), within=30, what="503s")
        server.start()
        await until_ready(caller)

        async with control(server) as redis:
            stored = await assert_consistent(redis, settings)
        lost = {
            **{("create", q): ledger.acked_at["create", q] for q in ledger.created if q not in stored},
            **{
                ("transition", q): ledger.acked_at["transition", q]
                for q in ledger.resolved
                if stored.get(q, {}).get("state") == "pending"
            },
        }
        surviving = [q for q in ledger.resolved if stored.get(q, {}).get("state", "pending") != "pending"]
        for question_id in surviving:
            reply = await caller.get(cast.agent, question_id)
            assert reply.body == ledger.resolved[question_id], f"{question_id} changed its story"
        recent = sum(1 for t in ledger.acked_at.values() if killed_at - 1.0 <= t <= killed_at)
        figure(
            "everysec-sigkill",
            acknowledged=len(ledger.acked_at),
            acknowledged_in_last_second=recent,
            lost_creates=sum(1 for kind, _ in lost if kind == "create"),
            lost_transitions=sum(1 for kind, _ in lost if kind == "transition"),
            oldest_lost_s_before_kill=f"{max((killed_at - t for t in lost.values()), default=0):.2f}",
        )
        too_old = {key: f"{killed_at - t:.2f} s" for key, t in lost.items() if killed_at - t > LOSS_WINDOW}
        assert not too_old, f"lost writes acknowledged long before the kill: {too_old}"
        assert ledger.unacceptable == [], ledger.unacceptable[:10]
        created = await caller.ask(cast.agent, {"user": "alice"})
        assert created.status == 201, "the service did not recover by itself"


# -- 5. CLIENT PAUSE -------------------------------------------------------------------------------

PAUSE_MS = 3000


@pytest.mark.parametrize(
    "socket_timeout",
    [5.0, 0.5],
    ids=["pause-shorter-than-socket-timeout", "pause-longer-than-socket-timeout"],
)
async def test_client_pause_under_load_ends_every_request_in_its_budget_and_half_writes_nothing(
    socket_timeout: float,
) -> None:
    """Invariants: while Redis is paused (`CLIENT PAUSE 3000 ALL`) under a mixed load, every
    request ends with a success or a 503 problem+json with Retry-After, within its budget (its
    long-poll timeout, plus the configured socket timeout per Redis attempt with retries, plus
    a grace); no waiter hangs past its long-poll timeout plus that budget; afterwards every
    question is consistent (`assert_consistent`), every acknowledged create and transition is
    present with its envelope, and every waiter parked before the pause whose question was
    answered got the stored terminal envelope. Run with a socket timeout longer than the pause
    (calls stall, then succeed) and much shorter (each attempt times out; with its retries a
    call gives up before the pause ends and the request ends in 503)."""
    async with (
        redis_server() as server,
        service(server, redis_timeout_seconds=socket_timeout, wait_max_seconds=30) as (
            client,
            api,
            caller,
            settings,
        ),
        control(server) as redis,
    ):
        cast = await make_cast(api)
        ledger = caller.ledger
        targets = [await caller.question(cast.agent, {"user": "alice"}) for _ in range(30)]
        parked = caller.waits(cast.agent, targets[:10], 8)
        await until_parked(client, targets[:10], parked)

        async with running_load(caller, cast):
            await eventually(lambda: _created_at_least(ledger, 80), within=30, what="load")
            assert await redis.execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")
            # Sent while the pause holds: it was confirmed and lasts 3 s.
            probes = await gather_by_kind(
                {
                    "answer": [caller.answer(cast.alice, q) for q in targets[:15]],
                    "cancel": [caller.cancel(cast.agent, q) for q in targets[15:20]],
                    "wait 2 s": [caller.wait(cast.agent, q, 2) for q in targets[20:25]],
                    "wait 6 s": [caller.wait(cast.agent, q, 6) for q in targets[25:30]],
                    "create": [caller.ask(cast.agent, {"room": "ops"}) for _ in range(10)],
                    "get": [caller.get(cast.alice, q) for q in targets[20:30]],
                    "readyz": [caller.call("GET", "/readyz")],
                }
            )
        waits = await asyncio.gather(*parked)

        assert ledger.unacceptable == [], ledger.unacceptable[:10]
        stored = await assert_consistent(redis, settings)
        await assert_acknowledged_present(caller, cast, ledger)
        transitions = zip(targets[:20], [*probes["answer"], *probes["cancel"]], strict=True)
        applied_despite_503 = sum(
            1 for q, reply in transitions if reply.status == 503 and stored[q]["state"] != "pending"
        )
        for question_id, wait in zip(targets[:10], waits, strict=True):
            assert wait.status in (200, 503), wait
            if question_id in ledger.resolved:
                assert wait.status == 200, wait
                assert wait.body == ledger.resolved[question_id]
    figure(
        f"client-pause(socket timeout {socket_timeout:g} s, pause {PAUSE_MS} ms)",
        probes={
            kind: f"{dict(sorted(Counter(r.status for r in replies).items()))} in <= "
            f"{max(r.elapsed for r in replies):.2f} s"
            for kind, replies in probes.items()
        },
        parked_waiters=dict(sorted(Counter(w.body.get("state", w.status) for w in waits).items())),
        transitions_answered_503_yet_applied=applied_despite_503,
        all_statuses=dict(sorted(ledger.statuses.items())),
    )


async def gather_by_kind(groups: Mapping[str, list[Awaitable[Seen]]]) -> dict[str, list[Seen]]:
    """Every call of every group at once; the replies grouped as the calls were."""
    flat = await asyncio.gather(*(call for calls in groups.values() for call in calls))
    grouped, start = {}, 0
    for kind, calls in groups.items():
        grouped[kind] = flat[start : start + len(calls)]
        start += len(calls)
    return grouped


class CapturingScripts:
    """Stands in for a store's Scripts: records each call (with the store's own keys and
    arguments) instead of running it, so a test can send the very same calls in one MULTI."""

    def __init__(self, real: Scripts) -> None:
        self.lua = real.lua
        self.calls: list[tuple[LuaScript, list[str], list[str | int]]] = []

    async def call(
        self, name: str, keys: Mapping[str, str], args: Mapping[str, str | int], **_: Any
    ) -> Reply:
        script = self.lua[name]
        self.calls.append((script, script.keys(keys), script.args(args)))
        return Reply(Code.APPLIED, fields={})


async def captured_answers(
    store: QuestionStore, ids: list[str], *, responder: str, option: str
) -> list[tuple[LuaScript, list[str], list[str | int]]]:
    """The script calls the store would make to answer each question, not yet sent."""
    capturing = CapturingScripts(store.scripts)
    shadow = copy.copy(store)
    shadow.scripts = capturing  # type: ignore[assignment]
    for question_id in ids:
        await shadow.answer(question_id, responder, option, [], new_call_id())
    return capturing.calls


# -- 11. pub/sub output buffer overrun -------------------------------------------------------------


async def test_pubsub_dropped_for_output_buffer_overrun_resubscribes_and_every_waiter_resolves() -> None:
    """Invariants: when Redis drops the service's pub/sub connection for overrunning
    `client-output-buffer-limit pubsub` (set to `1kb 512 1` here), the service resubscribes by
    itself and every parked waiter still resolves with the stored terminal envelope (through
    the re-read after the reconnect, since the publishes were lost with the connection), well
    before its own long-poll timeout; later waits are woken by pub/sub as before.

    How the reader is made "slow": one MULTI from a test connection answers 40 waited
    questions (each carrying ~600 B of metadata, so each terminal publish is ~1 KB). Redis
    queues all 40 publishes for the subscriber within one event-loop turn, before it writes
    any of them to the socket: beyond the 16 KB static reply buffer, the subscriber's output
    buffer then holds far more than 1 KB it has not read, exactly the state of a subscriber that
    drains slower than messages arrive, and Redis closes it (its log says "scheduled to be
    closed ASAP for overcoming of output buffer limits", checked below). Blocking the service's
    event loop instead would not reach the limit reliably: the kernel's socket buffers (MBs on
    loopback) absorb the backlog first."""
    async with (
        redis_server() as server,
        service(server, wait_max_seconds=60) as (client, api, caller, _),
        control(server) as redis,
    ):
        cast = await make_cast(api)
        app = client.server.app
        store = app[STORE]
        note = {"note": "x" * 600}
        ids = [await caller.question(cast.agent, {"user": "alice"}, metadata=note) for _ in range(40)]
        parked = caller.waits(cast.agent, ids * 2, 45)
        await until_parked(client, ids, parked)
        resubscriptions = app[WAITERS].resubscriptions
        await redis.config_set("client-output-buffer-limit", "pubsub 1kb 512 1")

        calls = await captured_answers(store, ids, responder="alice", option="yes")
        async with redis.pipeline(transaction=True) as pipe:
            for script, keys, args in calls:
                pipe.eval(script.source, len(keys), *keys, *args)
            results = await pipe.execute()
        assert [r[0] for r in results] == ["applied"] * len(ids)

        async with asyncio.timeout(30):  # well before the waiters' own 45 s
            woken = await asyncio.gather(*parked)
        log = (server.dir / "redis.log").read_text(errors="replace")
        assert "overcoming of output buffer limits" in log, "the pub/sub connection was never dropped"
        assert app[WAITERS].resubscriptions > resubscriptions
        for question_id, wait in zip(ids * 2, woken, strict=True):
            assert wait.status == 200, wait
            assert wait.body["state"] == "answered", wait
            assert wait.body == (await caller.get(cast.agent, question_id)).body

        # With the limit still in place, a normal-sized publish wakes a new waiter by pub/sub.
        later = await caller.question(cast.agent, {"user": "alice"})
        after_drop = app[WAITERS].resubscriptions
        (waiting,) = caller.waits(cast.agent, [later], 20)
        await until_parked(client, [later], [waiting])
        answered = await caller.answer(cast.alice, later)
        assert (await waiting).body == answered.body["question"]
        assert app[WAITERS].resubscriptions == after_drop, "woken by another reconnect, not by pub/sub"
        assert caller.ledger.unacceptable == [], caller.ledger.unacceptable[:10]
    figure(
        "pubsub-output-buffer",
        drops_logged=log.count("overcoming of output buffer limits"),
        resubscriptions=after_drop - resubscriptions,
        waiters_resolved=len(woken),
    )
