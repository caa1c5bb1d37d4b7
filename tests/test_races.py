"""The race storm: 500 questions, each hit at one moment by 23 concurrent actors through two app
instances on one Redis and prefix (two processes' worth of waiters, sweepers and keyspace
listeners). Every question must end with exactly one terminal story that every path agrees on.

Per question, at the same moment: 15 answer taps from the eligible users with different options
(duplicates included), a tap from an outsider, two cancels by the asker, two fetches, two
long-polls and one Sweeper.sweep_once. Long-lived questions are hit right after creation; those
with expires_in=1 are hit around their deadline (-80 ms .. +50 ms), racing the sweepers and the
keyspace listeners. Questions start 30 ms apart, so bursts overlap.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.http.appkeys import SWEEPER
from service.model import envelope
from service.scripts import pairs_to_fields
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import (
    TERMINAL,
    Http,
    ask_body,
    loop_time_of,
    ms,
    outbox_events,
    sleep_until,
    stats_totals,
    unbounded_session,
)
from tests.redis_server import RedisServer

QUESTIONS = 500
STAGGER = 0.03  # seconds between question starts
OPTIONS = ("a", "b", "c")
USERS = ("u0", "u1", "u2", "u3", "u4", "u5")
ROOMS = {"r0": ["u0", "u1", "u2"], "r1": ["u2", "u3", "u4"], "r2": ["u3", "u4", "u5", "u0"]}
AGENTS = ("agent-0", "agent-1")


@dataclass
class Plan:
    index: int
    asker: str
    to: dict[str, str]
    short: bool
    jitter: float
    eligible: list[str]
    outsider: str


@dataclass
class Hit:
    kind: str  # answer | outsider | cancel | get | wait | sweep
    who: str
    option: str | None
    status: int
    body: Any


@dataclass
class Story:
    plan: Plan
    created: dict[str, Any]
    hits: list[Hit] = field(default_factory=list)


def plans(rng: random.Random) -> list[Plan]:
    out = []
    for i in range(QUESTIONS):
        if i % 2 == 0:
            user = USERS[i % len(USERS)]
            to, eligible = {"user": user}, [user]
        else:
            room = sorted(ROOMS)[i % len(ROOMS)]
            to, eligible = {"room": room}, ROOMS[room][:3]
        outsider = next(u for u in USERS if u not in eligible and u not in ROOMS.get(to.get("room", ""), []))
        out.append(
            Plan(
                index=i,
                asker=AGENTS[(i // 2) % 2],
                to=to,
                short=i % 5 in (0, 2),
                jitter=rng.uniform(-0.08, 0.05),
                eligible=eligible,
                outsider=outsider,
            )
        )
    return out


def taps(plan: Plan) -> list[tuple[str, str]]:
    """15 answer taps (user, option): different options, and the same tap more than once."""
    if len(plan.eligible) == 1:
        return [(plan.eligible[0], OPTIONS[k % 3]) for k in range(15)]
    return [(user, OPTIONS[(k + j) % 3]) for j, user in enumerate(plan.eligible) for k in range(5)]


async def test_race_storm_every_question_has_exactly_one_terminal_story(
    redis_server: RedisServer, redis: Redis
) -> None:
    rng = random.Random(20260412)
    # The storm fires ~4,400 requests within a second at two apps and their client, all in this
    # one event loop. On a 2-core machine the calls queued for a pool connection (64 per app)
    # waited longer than the default 5 s and got 503 (in 3 of 4 runs on 2026-12-04: every held
    # connection under a second old, loop lag <= 0.8 s, so a queue, not a leak). Those were room
    # membership and token reads, which now share the coalescer's one connection instead; the
    # longer timeout stays because a slow machine's CPU still queues the storm. Overload 503s are
    # the chaos suite's subject; this test is about the one terminal story, so Redis calls may wait.
    settings = settings_for(
        redis_server.url, auth_cache_seconds=5, wait_max_seconds=15, redis_timeout_seconds=30.0
    )
    first = await start_client(settings)
    second = await start_client(settings)  # a second process on the same Redis and prefix
    try:
        stories, tokens = await storm(first, second, redis, rng)
        finals = await final_envelopes(first, stories, tokens)
    finally:
        await second.close()
        await first.close()

    problems: list[str] = []
    outcomes: Counter[str] = Counter()
    for story in stories:
        final = finals[story.created["id"]]
        outcomes[final["state"]] += 1
        problems.extend(check_story(story, final))
    problems.extend(await check_counters(redis, settings.key_prefix, finals, outcomes))

    assert not problems, f"{len(problems)} violations, first ones:\n" + "\n".join(problems[:15])
    assert sum(outcomes.values()) == QUESTIONS
    # The storm really raced all three endings.
    assert all(outcomes[state] > 0 for state in TERMINAL), outcomes


async def storm(
    first: TestClient[object, object], second: TestClient[object, object], redis: Redis, rng: random.Random
) -> tuple[list[Story], dict[str, str]]:
    api = Api(first, ADMIN_TOKEN)
    tokens = {p: await api.principal(p, "agent") for p in AGENTS}
    tokens |= {u: await api.principal(u, "user") for u in USERS}
    for room, members in ROOMS.items():
        await api.room(room, members)
    sweepers = [first.server.app[SWEEPER], second.server.app[SWEEPER]]
    all_plans = plans(rng)
    seed = rng.randrange(1 << 30)

    async with unbounded_session() as session:
        apps = [Http(session, first), Http(session, second)]
        loop = asyncio.get_running_loop()
        redis_epoch = await loop_time_of(redis, 0)  # loop time at which Redis TIME reads 0 ms
        start = loop.time() + 0.2

        async def one(plan: Plan) -> Story:
            await sleep_until(start + plan.index * STAGGER)
            status, created = await apps[(plan.index // 3) % 2].call(
                "POST",
                "/v1/questions",
                tokens[plan.asker],
                ask_body(plan.to, options=OPTIONS, expires_in=1 if plan.short else 60),
            )
            assert status == 201, created
            story = Story(plan, created)
            question_id = created["id"]
            fire = redis_epoch + ms(created["expires_at"]) / 1000 + plan.jitter if plan.short else loop.time()
            actors: list[tuple[str, str, str | None, Callable[[], Awaitable[tuple[int, Any]]]]] = []

            def add(
                kind: str, who: str, option: str | None, call: Callable[[], Awaitable[tuple[int, Any]]]
            ) -> None:
                actors.append((kind, who, option, call))

            for k, (user, option) in enumerate(taps(plan)):
                http = apps[k % 2]
                add(
                    "answer",
                    user,
                    option,
                    lambda h=http, u=user, o=option: h.answer(tokens[u], question_id, o),
                )
            add(
                "outsider",
                plan.outsider,
                "a",
                lambda: apps[0].answer(tokens[plan.outsider], question_id, "a"),
            )
            for http in apps:
                add("cancel", plan.asker, None, lambda h=http: h.cancel(tokens[plan.asker], question_id))
                add("wait", plan.asker, None, lambda h=http: h.wait(tokens[plan.asker], question_id, 10))
            add("get", plan.asker, None, lambda: apps[1].get(tokens[plan.asker], question_id))
            add("get", plan.eligible[-1], None, lambda: apps[0].get(tokens[plan.eligible[-1]], question_id))

            async def sweep() -> tuple[int, Any]:
                return 0, await sweepers[plan.index % 2].sweep_once()

            add("sweep", "sweeper", None, sweep)
            random.Random(seed + plan.index).shuffle(actors)

            async def act(call: Callable[[], Awaitable[tuple[int, Any]]]) -> tuple[int, Any]:
                await sleep_until(fire)
                return await call()

            results = await asyncio.gather(*(act(call) for _, _, _, call in actors))
            for (kind, who, option, _), (status, body) in zip(actors, results, strict=True):
                story.hits.append(Hit(kind, who, option, status, body))
            return story

        return list(await asyncio.gather(*(one(plan) for plan in all_plans))), tokens


async def final_envelopes(
    client: TestClient[object, object], stories: list[Story], tokens: dict[str, str]
) -> dict[str, Any]:
    """The story as a fetch tells it once the storm is over (after every actor has returned)."""
    async with unbounded_session() as session:
        http = Http(session, client)
        finals = {}
        for story in stories:
            status, body = await http.get(tokens[story.plan.asker], story.created["id"])
            assert status == 200, body
            finals[body["id"]] = body
    return finals


def differences(seen: dict[str, Any], final: dict[str, Any]) -> str:
    """What differs from the final envelope, field by field, as 'field: seen != final'."""
    fields = sorted(k for k in seen.keys() | final.keys() if seen.get(k) != final.get(k))
    return "; ".join(f"{k}: {seen.get(k)!r} != final {final.get(k)!r}" for k in fields)


def check_story(story: Story, final: dict[str, Any]) -> list[str]:
    question_id = story.created["id"]
    where = f"q#{story.plan.index} {question_id} ({'short' if story.plan.short else 'long'}, {story.plan.to})"
    problems = []

    def problem(text: str) -> None:
        problems.append(f"{where}: {text}")

    if final["state"] not in TERMINAL:
        problem(f"final state {final['state']}")
        return problems
    if final["version"] != 2:
        problem(f"final version {final['version']}")
    applied: list[Hit] = []
    for hit in story.hits:
        if hit.kind == "sweep":
            continue
        expected = 404 if hit.kind == "outsider" else 200
        if hit.status != expected:
            problem(f"{hit.kind} by {hit.who} got {hit.status}: {hit.body}")
            continue
        if hit.kind in ("answer", "cancel"):
            if hit.body["question"] != final:
                problem(f"{hit.kind} by {hit.who} replied {differences(hit.body['question'], final)}")
            if hit.body["applied"]:
                applied.append(hit)
        elif hit.kind == "wait":
            if hit.body != final:
                problem(f"wait replied {differences(hit.body, final)}")
        elif hit.kind == "get" and hit.body not in (final, story.created):
            problem(f"fetch replied {differences(hit.body, final)}: neither the created nor the final one")

    if len(applied) > 1:
        problem(f"{len(applied)} applied:true replies: {[(h.kind, h.who, h.option) for h in applied]}")
    state = final["state"]
    created_ms, expires_ms = ms(final["created_at"]), ms(final["expires_at"])
    resolved_ms = ms(final["resolved_at"])
    if state == "answered":
        answer = final["answer"]
        if ms(answer["answered_at"]) >= expires_ms:
            problem(f"answered at {answer['answered_at']}, at or after the deadline {final['expires_at']}")
        if final["resolved_at"] != answer["answered_at"]:
            problem("resolved_at differs from answered_at")
        if [(h.kind, h.who, h.option) for h in applied] != [
            ("answer", answer["responder"], answer["option"])
        ]:
            problem(f"the applied replies {applied} do not name the recorded answer {answer}")
        if answer["responder"] not in story.plan.eligible:
            problem(f"answered by {answer['responder']}, who is not eligible")
    elif state == "cancelled":
        if not created_ms <= resolved_ms < expires_ms:
            problem(f"cancelled at {final['resolved_at']}, outside [created, deadline)")
        if [(h.kind, h.who) for h in applied] != [("cancel", story.plan.asker)]:
            problem(f"the applied replies {applied} do not match a cancel by the asker")
        if final["cancellation"]["by"] != story.plan.asker or final["answer"] is not None:
            problem(f"cancellation story {final['cancellation']} / answer {final['answer']}")
    else:
        if final["resolved_at"] != final["expires_at"]:
            problem(f"expired at {final['resolved_at']}, deadline {final['expires_at']}")
        if applied:
            problem(f"expired, yet these replies said applied: {applied}")
        if final["answer"] is not None or final["cancellation"] is not None:
            problem("an expired question carries an answer or a cancellation")
        if not story.plan.short:
            problem("a 60 s question expired during the storm")
    return problems


async def check_counters(
    redis: Redis, prefix: str, finals: dict[str, Any], outcomes: Counter[str]
) -> list[str]:
    problems = []
    stats = await stats_totals(redis, prefix)
    wanted = {"created": QUESTIONS, **{state: outcomes[state] for state in TERMINAL}}
    got = {name: stats[name] for name in wanted}
    if got != wanted:
        problems.append(f"bucket stats {got} != outcomes {wanted}")
    events: dict[str, list[dict[str, str]]] = defaultdict(list)
    for event in await outbox_events(redis, prefix):
        events[event["id"]].append(event)
    for question_id, final in finals.items():
        kinds = [e["type"] for e in events[question_id]]
        if kinds != ["question.created", f"question.{final['state']}"]:
            problems.append(f"{question_id}: outbox events {kinds}, final state {final['state']}")
            continue
        told = envelope(pairs_to_fields(json.loads(events[question_id][1]["question"])))
        if told != final:
            problems.append(f"{question_id}: outbox envelope {differences(told, final)}")
    return problems
