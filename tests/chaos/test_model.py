"""Model-based test: random interleavings against the real service, compared with tests/chaos/model.py.

One `python -m service serve` process (with its own sweeper and keyspace listener) runs against
the session's real redis-server, and a hypothesis state machine drives it over HTTP: creates
(direct and room, with and without Idempotency-Key, replays with the same and another body),
answers by eligible and ineligible principals, duplicate taps, concurrent taps and cancels,
cancels by the asker and by others, fetches, long-polls, batch waits, lists, extra sweep passes
from this process, room membership changes, and sleeps past 1-second deadlines. Every status,
every reply field and every envelope must be what the model allows; the first terminal
envelope of each question must never change (checked after every step).

Each request is bracketed by two readings of Redis TIME (the service's only clock), so near a
deadline the model accepts "pending" or "expired" only when the bracket straddles it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
)

from bench.procs import ADMIN_TOKEN, ServiceProc
from service.keys import BUCKETS, Keys
from service.redis_client import connect
from service.scripts import Scripts
from service.settings import Settings
from service.store import QuestionStore
from service.sweeper import Sweeper
from tests.chaos.model import (
    ADMIN,
    EXPIRED,
    PENDING,
    STATES,
    Action,
    Ask,
    Model,
    Question,
    check,
    parse_ms,
    wire,
)
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(400)]

SHORT, LONG = 1, 60  # expires_in: a deadline the machine sleeps past, and one it never reaches
OPTION_POOL = ("yes", "no", "later", "abort")
STAT_FIELDS = ("created", "answered", "expired", "cancelled", "stale")
PARKED_WAIT = 8  # seconds; the service's QS_WAIT_MAX_SECONDS is 10
ROLES = ("A0", "A1", "U0", "U1", "U2", "admin")


class Live:
    """The service under test, HTTP clients, a Redis connection for TIME and direct checks, and
    a second sweeper (as another worker process would run one)."""

    def __init__(self, service: ServiceProc, redis_url: str, prefix: str) -> None:
        self.service = service
        self.keys = Keys(prefix)
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.http = httpx.Client(base_url=service.url, timeout=30)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tap")
        self.clients = threading.local()
        self.opened: list[httpx.Client] = []
        self.runner = asyncio.Runner()
        settings = Settings(redis_url=redis_url, key_prefix=prefix)
        self.async_redis = connect(settings)
        scripts = Scripts(self.async_redis)
        self.runner.run(scripts.load_all())
        self.sweeper = Sweeper(QuestionStore(self.async_redis, scripts, settings), 1.0)

    def now_ms(self) -> int:
        seconds, micros = self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def client(self) -> httpx.Client:
        """One client per worker thread (the main thread uses self.http)."""
        if threading.current_thread() is threading.main_thread():
            return self.http
        found: httpx.Client | None = getattr(self.clients, "http", None)
        if found is None:
            found = httpx.Client(base_url=self.service.url, timeout=30)
            self.clients.http = found
            self.opened.append(found)
        return found

    def stats(self) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for b in range(BUCKETS):
            pipe.hgetall(self.keys.stats(b))
        totals = dict.fromkeys(STAT_FIELDS, 0)
        for counters in pipe.execute():
            for name in STAT_FIELDS:
                totals[name] += int(counters.get(name, 0))
        return totals

    def stored_state(self, question_id: str) -> str | None:
        state: str | None = self.redis.hget(self.keys.for_question(question_id).question, "state")
        return state

    def until_subscribed(self, question_id: str, waiting: Future[Reply]) -> None:
        """Until the service subscribed to the question's channel for a parked wait (or the wait
        returned at once, as it does for a terminal question). Polls Redis: no fixed sleep."""
        channel = self.keys.for_question(question_id).channel
        limit = time.monotonic() + PARKED_WAIT
        while not waiting.done() and time.monotonic() < limit:
            [(_, subscribers)] = self.redis.pubsub_numsub(channel)
            if int(subscribers) > 0:
                return
            time.sleep(0.002)

    def sweep(self) -> None:
        self.runner.run(self.sweeper.sweep_once())

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for c in [self.http, *self.opened]:
            c.close()
        self.runner.run(self.async_redis.aclose())
        self.runner.close()
        self.redis.close()


LIVE: Live | None = None


@pytest.fixture(scope="module", autouse=True)
def live_service(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    global LIVE
    workdir: Path = tmp_path_factory.mktemp("model")
    prefix = f"m{uuid.uuid4().hex[:10]}"
    service = ServiceProc(
        workdir,
        redis_server.url,
        key_prefix=prefix,
        sweep_interval_seconds="0.2",
        auth_cache_seconds="0",
        wait_max_seconds="10",
        wait_default_seconds="5",
        log_level="WARNING",
    ).start()
    LIVE = Live(service, redis_server.url, prefix)
    try:
        yield LIVE
    finally:
        LIVE.close()
        LIVE = None
        service.stop()
    log = service.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    assert " ERROR " not in log, log[-4000:]


def live() -> Live:
    assert LIVE is not None, "the live_service fixture did not run"
    return LIVE


class Reply:
    """One HTTP exchange and the Redis TIME bracket around it."""

    def __init__(self, response: httpx.Response, t0: int, t1: int) -> None:
        self.response, self.t0, self.t1 = response, t0, t1
        self.status = response.status_code
        self.body: Any = response.json() if response.content else None

    def expect(self, status: int) -> Any:
        check(self.status == status, f"expected {status}, got {self.status}: {self.body}")
        if status >= 400:
            check(
                self.response.headers["content-type"].startswith("application/problem+json"),
                f"a {status} is not problem+json: {self.response.headers['content-type']}",
            )
            check(self.body["status"] == status, f"problem status {self.body['status']} != {status}")
        return self.body


class QuestionMachine(RuleBasedStateMachine):
    questions = Bundle("questions")

    def __init__(self) -> None:
        super().__init__()
        self.live = live()
        tag = uuid.uuid4().hex[:8]
        self.ids = {r: f"{r.lower()}-{tag}" for r in ROLES if r != "admin"} | {"admin": ADMIN}
        self.room = f"room-{tag}"
        self.tokens = {ADMIN: ADMIN_TOKEN}
        for role in ROLES[:5]:
            kind = "agent" if role.startswith("A") else "user"
            body = {"id": self.ids[role], "kind": kind}
            reply = self.call("POST", "/v1/admin/principals", ADMIN, body).expect(201)
            self.tokens[self.ids[role]] = reply["token"]
        members = [self.ids["U0"], self.ids["U1"]]
        self.call("PUT", f"/v1/admin/rooms/{self.room}", ADMIN, {"members": members}).expect(200)
        self.model = Model(
            agents=[self.ids["A0"], self.ids["A1"]],
            users=[self.ids["U0"], self.ids["U1"], self.ids["U2"]],
            rooms={self.room: set(members)},
            note=event,
        )
        self.baseline = self.live.stats()

    # -- plumbing -------------------------------------------------------------------------------

    def call(
        self,
        method: str,
        path: str,
        principal: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        sent = {"Authorization": f"Bearer {self.tokens[principal]}", **(headers or {})}
        client = self.live.client()
        t0 = self.live.now_ms()
        response = client.request(method, path, json=body, headers=sent)
        t1 = self.live.now_ms()
        return Reply(response, t0, t1)

    def q(self, question_id: str) -> Question:
        return self.model.questions[question_id]

    # -- create ---------------------------------------------------------------------------------

    @rule(
        target=questions,
        asker=st.sampled_from(["A0", "A0", "A1", "U0"]),
        to=st.sampled_from(["U0", "U2", "room", "room", "ghost", "agent"]),
        short=st.booleans(),
        idempotency=st.sampled_from([None, None, "new", "same", "different"]),
        pick=st.integers(0, 1000),
        prompt=st.sampled_from(["Deploy?", "Restart the ingest workers?", "Déployer ✓ ?"]),
        options=st.lists(st.sampled_from(OPTION_POOL), min_size=2, max_size=4, unique=True),
        metadata=st.dictionaries(
            st.sampled_from(["build", "env", "n"]), st.integers(0, 9999) | st.text(max_size=4), max_size=2
        ),
    )
    def create(
        self,
        asker: str,
        to: str,
        short: bool,
        idempotency: str | None,
        pick: int,
        prompt: str,
        options: list[str],
        metadata: dict[str, Any],
    ) -> Any:
        target = {
            "U0": {"user": self.ids["U0"]},
            "U2": {"user": self.ids["U2"]},
            "room": {"room": self.room},
            "ghost": {"user": "ghost-" + self.room},
            "agent": {"user": self.ids["A1"]},
        }[to]
        ask = Ask(self.ids[asker], target, prompt, tuple(options), SHORT if short else LONG, metadata)
        key = None
        if idempotency == "new":
            key = uuid.uuid4().hex
        elif idempotency is not None and self.model.idempotency:
            used = sorted(self.model.idempotency)
            _, key = used[pick % len(used)]
            remembered = self.model.idempotency.get((ask.asker, key))
            if remembered is not None:
                ask = remembered[0]
                if idempotency == "different":
                    ask = replace(ask, prompt=ask.prompt + " (again)")
        headers = {"Idempotency-Key": key} if key else None
        reply = self.call("POST", "/v1/questions", ask.asker, ask.body(), headers)
        return self.created(ask, key, reply)

    def created(self, ask: Ask, key: str | None, reply: Reply) -> Any:
        if self.model.kind(ask.asker) != "agent":
            reply.expect(403)
            return multiple()
        target_user = ask.to.get("user")
        if target_user is not None and not self.model.user_exists(target_user):
            reply.expect(422)
            return multiple()
        remembered = None if key is None else self.model.idempotency.get((ask.asker, key))
        if remembered is not None:
            if remembered[0] != ask:
                event("idempotency key reused with another body")
                reply.expect(422)
                return multiple()
            original = self.q(remembered[1])
            envelope = reply.expect(200)
            check(reply.response.headers["Location"] == f"/v1/questions/{original.id}", "replay Location")
            self.model.read(original, envelope, reply.t0, reply.t1, "idempotent replay")
            event("idempotent replay")
            return multiple()
        envelope = reply.expect(201)
        question_id = envelope["id"]
        check(reply.response.headers["Location"] == f"/v1/questions/{question_id}", "create Location")
        self.model.created(question_id, ask, envelope, reply.t0, reply.t1)
        if key is not None:
            self.model.idempotency[(ask.asker, key)] = (ask, question_id)
        return multiple(question_id)

    # -- answer and cancel ----------------------------------------------------------------------

    def answer_once(self, question_id: str, role: str, option_pick: int) -> None:
        q, principal = self.q(question_id), self.ids[role]
        option = q.ask.option_ids[option_pick] if option_pick < len(q.ask.option_ids) else "maybe"
        status = self.model.answer_status(principal, q, option)
        reply = self.call("POST", f"/v1/questions/{question_id}/answer", principal, {"option": option})
        body = reply.expect(status)
        if status == 200:
            self.model.tap(
                q, body["applied"], body["question"], reply.t0, reply.t1, Action("answer", principal, option)
            )

    @rule(
        q=questions,
        role=st.sampled_from(["U0", "U0", "U1", "U2", "A0", "A1", "admin"]),
        option=st.integers(0, 4),
    )
    def answer(self, q: str, role: str, option: int) -> None:
        self.answer_once(q, role, option)

    @rule(q=questions, role=st.sampled_from(["U0", "U1"]), option=st.integers(0, 1))
    def duplicate_tap(self, q: str, role: str, option: int) -> None:
        """The same tap twice (a retried request, a second notification)."""
        self.answer_once(q, role, option)
        self.answer_once(q, role, option)

    @rule(
        q=questions,
        role=st.sampled_from(["A0", "A0", "A1", "U0", "U1", "U2", "admin"]),
        reason=st.sampled_from([None, "", "workflow changed", "sent to the wrong room ✓"]),
    )
    def cancel(self, q: str, role: str, reason: str | None) -> None:
        question, principal = self.q(q), self.ids[role]
        status = self.model.cancel_status(principal, question)
        body = None if reason is None else {"reason": reason}
        reply = self.call("POST", f"/v1/questions/{q}/cancel", principal, body)
        result = reply.expect(status)
        if status == 200:
            action = Action("cancel", principal, reason=reason or "")
            self.model.tap(question, result["applied"], result["question"], reply.t0, reply.t1, action)

    @rule(
        q=questions,
        taps=st.lists(
            st.tuples(st.sampled_from(["U0", "U1", "U2", "asker", "A1"]), st.integers(0, 2)),
            min_size=2,
            max_size=4,
        ),
    )
    def concurrent_taps(self, q: str, taps: list[tuple[str, int]]) -> None:
        """Answers (and the asker's cancels) sent at once: one story, at most one applied."""
        question = self.q(q)
        planned = []
        for role, pick in taps:
            if role == "asker":
                action = Action("cancel", question.ask.asker, reason="raced")
                status = self.model.cancel_status(action.principal, question)
            else:
                principal = self.ids[role]
                option = question.ask.option_ids[pick] if pick < len(question.ask.option_ids) else "maybe"
                action = Action("answer", principal, option)
                status = self.model.answer_status(principal, question, option)
            planned.append((action, status))

        def send(action: Action) -> Reply:
            if action.kind == "cancel":
                return self.call(
                    "POST", f"/v1/questions/{q}/cancel", action.principal, {"reason": action.reason}
                )
            return self.call("POST", f"/v1/questions/{q}/answer", action.principal, {"option": action.option})

        t0 = self.live.now_ms()
        replies = list(self.live.pool.map(send, [a for a, _ in planned]))
        t1 = self.live.now_ms()
        reached = []
        for (action, status), reply in zip(planned, replies, strict=True):
            body = reply.expect(status)
            if status == 200:
                reached.append((action, body["applied"], body["question"]))
        if reached:
            self.model.race(question, reached, t0, t1)

    @rule(q=questions, by_cancel=st.booleans())
    def wait_while_resolving(self, q: str, by_cancel: bool) -> None:
        """A long-poll parked on a pending question is woken by its transition and returns
        that very story (not the pending envelope, and not only when its timeout runs out)."""
        question = self.q(q)
        asker = question.ask.asker
        responders = [u for u in self.model.users if self.model.answer_status(u, question, "x") != 404]
        t0, started = self.live.now_ms(), time.monotonic()
        path = f"/v1/questions/{q}"
        waiting = self.live.pool.submit(self.call, "GET", f"{path}/wait?timeout={PARKED_WAIT}", asker)
        self.live.until_subscribed(q, waiting)
        if by_cancel or not responders:
            action = Action("cancel", asker, reason="resolved while waited on")
            tap = self.call("POST", path + "/cancel", asker, {"reason": action.reason})
        else:
            action = Action("answer", sorted(responders)[0], question.ask.option_ids[0])
            tap = self.call("POST", path + "/answer", action.principal, {"option": action.option})
        body = tap.expect(200)
        self.model.tap(question, body["applied"], body["question"], tap.t0, tap.t1, action)
        waited = waiting.result().expect(200)
        check(
            time.monotonic() - started < PARKED_WAIT,
            "the parked wait was not woken by the transition: it ran into its timeout",
        )
        check(wire(waited) == wire(body["question"]), f"the waiter got another story:\n{waited}\n{body}")
        self.model.read(question, waited, t0, self.live.now_ms(), "wait during resolution")

    # -- reads ----------------------------------------------------------------------------------

    @rule(q=questions, role=st.sampled_from(ROLES))
    def fetch(self, q: str, role: str) -> None:
        question, principal = self.q(q), self.ids[role]
        reply = self.call("GET", f"/v1/questions/{q}", principal)
        if not self.model.visible(principal, question):
            reply.expect(404)
            return
        self.model.read(question, reply.expect(200), reply.t0, reply.t1, "fetch")

    @rule(q=questions, role=st.sampled_from(ROLES), timeout=st.sampled_from([0, 0.05, 0.3]))
    def wait(self, q: str, role: str, timeout: float) -> None:
        question, principal = self.q(q), self.ids[role]
        reply = self.call("GET", f"/v1/questions/{q}/wait?timeout={timeout}", principal)
        if not self.model.visible(principal, question):
            reply.expect(404)
            return
        self.model.read(question, reply.expect(200), reply.t0, reply.t1, f"wait {timeout}")

    def has_questions(self) -> bool:
        return bool(self.model.questions)

    @precondition(has_questions)
    @rule(
        qs=st.lists(questions, min_size=1, max_size=5),
        role=st.sampled_from(["A0", "U0", "admin", "admin"]),
        mode=st.sampled_from(["any", "all"]),
        timeout=st.sampled_from([0, 0.1]),
    )
    def batch_wait(self, qs: list[str], role: str, mode: str, timeout: float) -> None:
        principal = self.ids[role]
        body = {"ids": qs, "mode": mode, "timeout": timeout}
        reply = self.call("POST", "/v1/questions/wait", principal, body)
        unique = list(dict.fromkeys(qs))
        if not all(self.model.visible(principal, self.q(i)) for i in unique):
            reply.expect(404)
            return
        result = reply.expect(200)
        check([item["id"] for item in result["items"]] == unique, f"batch wait items {result['items']}")
        for item in result["items"]:
            self.model.read(self.q(item["id"]), item, reply.t0, reply.t1, "batch wait")
        terminal = [item["state"] != PENDING for item in result["items"]]
        met = all(terminal) if mode == "all" else any(terminal)
        check(result["condition_met"] is met and result["mode"] == mode, f"batch wait: {result}")

    @rule(role=st.sampled_from(ROLES), state=st.sampled_from([None, *STATES]))
    def list_questions(self, role: str, state: str | None) -> None:
        principal = self.ids[role]
        query = "?limit=200" + (f"&state={state}" if state else "")
        room = self.room if principal == ADMIN else None
        if room:
            query += f"&room={room}"
        reply = self.call("GET", "/v1/questions" + query, principal)
        page = reply.expect(200)
        check(page["next_cursor"] is None, "one page holds every question of a run")
        shown = {item["id"]: item for item in page["items"]}
        covered = {q.id: q for q in self.model.listed(principal, room)}
        check(set(shown) <= set(covered), f"list shows foreign ids {set(shown) - set(covered)}")
        order = [(parse_ms(i["created_at"]), i["id"]) for i in page["items"]]
        check(order == sorted(order, reverse=True), "list is not newest first")
        for question in covered.values():
            if question.id in shown:
                item = shown[question.id]
                check(state is None or item["state"] == state, f"list state={state} shows {item['state']}")
                self.model.read(question, item, reply.t0, reply.t1, "list")
                continue
            self.absent_from_list(question, state, reply)

    def absent_from_list(self, question: Question, state: str | None, reply: Reply) -> None:
        """Left out by the state filter: what the list read must have seen fails the filter."""
        check(state is not None, f"list without a filter leaves out {question.id}")
        phases = question.phases(reply.t0, reply.t1)
        could_show = {EXPIRED if p == "overdue" else p for p in phases}
        failing = {s for s in could_show if s != state}
        check(bool(failing), f"list state={state} leaves out {question.id} ({question.state})")
        if failing == {EXPIRED} and question.state == PENDING:
            question.expire()  # the list's read expired it

    # -- time and sweeps ------------------------------------------------------------------------

    def short_pending(self) -> bool:
        return any(not q.terminal and q.ask.expires_in == SHORT for q in self.model.questions.values())

    @precondition(short_pending)
    @rule(offset_ms=st.sampled_from([-30, 0, 5, 60]))
    def advance_past_deadline(self, offset_ms: int) -> None:
        """Sleep to (about) the next short deadline: real time, the system clock is untouched."""
        now = self.live.now_ms()
        due = [
            q.expires_ms + offset_ms
            for q in self.model.questions.values()
            if not q.terminal and q.expires_ms + offset_ms > now
        ]
        if due and min(due) - now <= 1200:
            time.sleep((min(due) - now) / 1000)

    @precondition(short_pending)
    @rule(
        pick=st.integers(0, 100), lead_ms=st.sampled_from([-3, -1, 0, 1, 2, 5, 20]), by_cancel=st.booleans()
    )
    def tap_at_deadline(self, pick: int, lead_ms: int, by_cancel: bool) -> None:
        """Sleep to a pending question's deadline (give or take a few ms) and tap at once: the
        tap races the service's sweeper and keyspace listener, which fire at the same moment."""
        now = self.live.now_ms()
        ahead = [
            q
            for q in self.model.questions.values()
            if not q.terminal and 0 < q.expires_ms + lead_ms - now <= 1200
        ]
        if not ahead:
            return
        question = ahead[pick % len(ahead)]
        time.sleep((question.expires_ms + lead_ms - self.live.now_ms()) / 1000)
        responders = [u for u in self.model.users if self.model.answer_status(u, question, "x") != 404]
        path = f"/v1/questions/{question.id}"
        if by_cancel or not responders:
            action = Action("cancel", question.ask.asker, reason="at the deadline")
            reply = self.call("POST", path + "/cancel", action.principal, {"reason": action.reason})
        else:
            action = Action("answer", sorted(responders)[-1], question.ask.option_ids[-1])
            reply = self.call("POST", path + "/answer", action.principal, {"option": action.option})
        result = reply.expect(200)
        self.model.tap(question, result["applied"], result["question"], reply.t0, reply.t1, action)

    @rule()
    def sweep(self) -> None:
        """One more sweep pass, from this process: afterwards nothing overdue is stored pending."""
        t0 = self.live.now_ms()
        self.live.sweep()
        for question in self.model.questions.values():
            if question.terminal or question.expires_ms > t0:
                continue
            stored = self.live.stored_state(question.id)
            check(stored == EXPIRED, f"after a sweep, overdue {question.id} is stored {stored!r}")
            question.expire()

    @rule(role=st.sampled_from(["U1", "U2"]))
    def toggle_membership(self, role: str) -> None:
        user, members = self.ids[role], self.model.rooms[self.room]
        path = f"/v1/admin/rooms/{self.room}/members/{user}"
        if user in members:
            self.call("DELETE", path, ADMIN).expect(204)
            members.discard(user)
        else:
            reply = self.call("PUT", path, ADMIN).expect(200)
            members.add(user)
            check(set(reply["members"]) == members, f"room members {reply['members']} != {members}")

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def terminal_envelopes_never_change(self) -> None:
        ids = sorted(self.model.terminal_wire)
        for start in range(0, len(ids), 100):
            chunk = ids[start : start + 100]
            reply = self.call("POST", "/v1/questions/wait", ADMIN, {"ids": chunk, "timeout": 0})
            for item in reply.expect(200)["items"]:
                first = self.model.terminal_wire[item["id"]]
                check(wire(item) == first, f"terminal envelope changed:\n{first}\n{wire(item)}")

    @invariant()
    def stats_count_each_story_once(self) -> None:
        now = self.live.stats()
        t1 = self.live.now_ms()
        seen = {name: now[name] - self.baseline[name] for name in STAT_FIELDS}
        c = self.model.counters
        expected = {"created": c.created, "answered": c.answered, "cancelled": c.cancelled, "stale": c.stale}
        check({k: seen[k] for k in expected} == expected, f"stats {seen} != model {expected}")
        low = self.model.expired()
        high = low + self.model.overdue_unseen(t1)
        check(low <= seen["expired"] <= high, f"stats expired {seen['expired']} not in [{low}, {high}]")

    def teardown(self) -> None:
        """Leave nothing pending, so no later transition of this run's questions moves the
        shared stats counters under the next run."""
        for question in self.model.questions.values():
            if question.state == PENDING:
                # If this fails the run has failed already; the next run's baseline absorbs it.
                with contextlib.suppress(httpx.HTTPError):
                    self.call("POST", f"/v1/questions/{question.id}/cancel", ADMIN)


QuestionMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "100")),
    stateful_step_count=int(os.environ.get("MODEL_STEPS", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCase = QuestionMachine.TestCase
