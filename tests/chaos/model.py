"""A plain Python model of the question state machine (spec: question-state-machine.md).

No I/O here. The model says what the service must reply, given who asks and when (a bracket
[t0, t1] of Redis TIME readings taken just before and just after the request, because Redis
TIME is the one clock of every state decision). Near a deadline the bracket may straddle it;
only then may a reply show the question either still pending or expired, and whichever the
reply shows becomes the model's truth. Outside that window the model is strict.

Timestamps the model cannot know in advance (created_at, answered_at, resolved_at of an answer
or a cancellation) are learned from the reply that made them, after checking they lie inside the
bracket of that reply; everything else of an envelope is predicted.
"""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PENDING, ANSWERED, EXPIRED, CANCELLED = "pending", "answered", "expired", "cancelled"
STATES = (PENDING, ANSWERED, EXPIRED, CANCELLED)
ADMIN = "admin"  # the id of the bootstrap admin (QS_ADMIN_TOKEN)


class ModelMismatch(AssertionError):
    """The service replied something the model does not allow."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ModelMismatch(message)


def render_ms(ms: int) -> str:
    """RFC 3339 UTC with milliseconds, the envelope's timestamp format."""
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def parse_ms(text: str) -> int:
    check(text.endswith("Z") and len(text) == 24, f"timestamp {text!r} is not RFC 3339 UTC with ms")
    whole, millis = text[:-1].split(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) * 1000 + int(millis)


def wire(value: Any) -> str:
    """A JSON value as compact text, keys in the order received: equal text == equal bytes."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Ask:
    """What an agent sent to create a question (also the idempotency 'same body')."""

    asker: str
    to: dict[str, str]
    prompt: str
    option_ids: tuple[str, ...]
    expires_in: int
    metadata: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "options": [{"id": o, "label": o.title()} for o in self.option_ids],
            "to": self.to,
            "expires_in": self.expires_in,
            "metadata": self.metadata,
        }


@dataclass
class Question:
    id: str
    ask: Ask
    created_ms: int
    state: str = PENDING
    resolved_ms: int | None = None
    answer: tuple[str, str, int] | None = None  # option, responder, answered ms
    cancellation: tuple[str, str | None] | None = None  # by, reason (None for '')

    @property
    def expires_ms(self) -> int:
        return self.created_ms + self.ask.expires_in * 1000

    @property
    def terminal(self) -> bool:
        return self.state != PENDING

    def phases(self, t0: int, t1: int) -> set[str]:
        """What a script run somewhere in [t0, t1] may find: the stored terminal story, or
        'pending' (before the deadline) and/or 'overdue' (at or after it)."""
        if self.terminal:
            return {self.state}
        found = set()
        if t0 < self.expires_ms:
            found.add(PENDING)
        if t1 >= self.expires_ms:
            found.add("overdue")
        return found

    def expire(self) -> None:
        assert self.state == PENDING
        self.state, self.resolved_ms = EXPIRED, self.expires_ms

    def envelope(self) -> dict[str, Any]:
        a = self.ask
        return {
            "id": self.id,
            "state": self.state,
            "prompt": a.prompt,
            "options": [{"id": o, "label": o.title()} for o in a.option_ids],
            "to": a.to,
            "asker": a.asker,
            "created_at": render_ms(self.created_ms),
            "expires_at": render_ms(self.expires_ms),
            "resolved_at": None if self.resolved_ms is None else render_ms(self.resolved_ms),
            "answer": None
            if self.answer is None
            else {
                "option": self.answer[0],
                "responder": self.answer[1],
                "answered_at": render_ms(self.answer[2]),
            },
            "cancellation": None
            if self.cancellation is None
            else {"by": self.cancellation[0], "reason": self.cancellation[1]},
            "metadata": a.metadata,
            "version": 2 if self.terminal else 1,
        }


@dataclass
class Counters:
    """What the service's stats hashes must have counted since the model started."""

    created: int = 0
    answered: int = 0
    cancelled: int = 0
    stale: int = 0


@dataclass
class Model:
    agents: list[str]
    users: list[str]
    rooms: dict[str, set[str]]
    questions: dict[str, Question] = field(default_factory=dict)
    idempotency: dict[tuple[str, str], tuple[Ask, str]] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    # The first terminal envelope seen for each question, as wire text: it must never change.
    terminal_wire: dict[str, str] = field(default_factory=dict)
    # Told what happened (for coverage statistics: hypothesis.event).
    note: Callable[[str], None] = lambda _: None

    # -- who may do what ------------------------------------------------------------------------

    def kind(self, principal: str) -> str:
        if principal == ADMIN:
            return "admin"
        return "agent" if principal in self.agents else "user"

    def user_exists(self, user: str) -> bool:
        return user in self.users

    def visible(self, principal: str, q: Question) -> bool:
        if principal == ADMIN or principal == q.ask.asker:
            return True
        if self.kind(principal) != "user":
            return False
        if "user" in q.ask.to:
            return q.ask.to["user"] == principal
        return principal in self.rooms[q.ask.to["room"]]

    def answer_status(self, principal: str, q: Question, option: str) -> int:
        """The HTTP status of an answer before the state is looked at (200: it reaches it)."""
        if self.kind(principal) != "user":
            return 403 if self.visible(principal, q) else 404
        if not self.visible(principal, q):
            return 404  # for users, eligible == visible
        if option not in q.ask.option_ids:
            return 422
        return 200

    def cancel_status(self, principal: str, q: Question) -> int:
        if principal == ADMIN or principal == q.ask.asker:
            return 200
        return 403 if self.visible(principal, q) else 404

    def listed(self, principal: str, room: str | None) -> list[Question]:
        """The questions a list by this principal covers (before any state filter)."""
        if principal == ADMIN:
            return [q for q in self.questions.values() if q.ask.to.get("room") == room]
        if self.kind(principal) == "agent":
            return [q for q in self.questions.values() if q.ask.asker == principal]
        mine = {r for r, members in self.rooms.items() if principal in members}
        return [
            q
            for q in self.questions.values()
            if q.ask.to.get("user") == principal or q.ask.to.get("room") in mine
        ]

    def overdue_unseen(self, now_ms: int) -> int:
        """Pending in the model but past the deadline: Redis may or may not have expired them."""
        return sum(1 for q in self.questions.values() if not q.terminal and now_ms >= q.expires_ms)

    def expired(self) -> int:
        return sum(1 for q in self.questions.values() if q.state == EXPIRED)

    # -- observations ---------------------------------------------------------------------------

    def created(self, question_id: str, ask: Ask, envelope: dict[str, Any], t0: int, t1: int) -> Question:
        created_ms = parse_ms(envelope["created_at"])
        check(t0 <= created_ms <= t1, f"created_at {created_ms} outside the request's [{t0}, {t1}]")
        check(question_id not in self.questions, f"id {question_id} handed out twice")
        q = Question(question_id, ask, created_ms)
        self.questions[question_id] = q
        self.counters.created += 1
        self.same(q, envelope, "create reply")
        return q

    def read(self, q: Question, envelope: dict[str, Any], t0: int, t1: int, path: str) -> None:
        """A read (fetch, wait, list, batch wait, idempotent replay): it may expire an overdue
        question, and changes nothing else."""
        phases = q.phases(t0, t1)
        shown = envelope.get("state")
        if len(phases) > 1:
            self.note(f"read straddling the deadline showed {shown}")
        if q.terminal:
            self.same(q, envelope, path)
            return
        if shown == PENDING:
            check(PENDING in phases, f"{path}: {q.id} shown pending at [{t0}, {t1}], deadline {q.expires_ms}")
        elif shown == EXPIRED:
            check(
                "overdue" in phases, f"{path}: {q.id} shown expired at [{t0}, {t1}], deadline {q.expires_ms}"
            )
            q.expire()
        else:
            raise ModelMismatch(f"{path}: pending {q.id} shown {shown!r} by a read")
        self.same(q, envelope, path)

    def tap(
        self, q: Question, applied: Any, envelope: dict[str, Any], t0: int, t1: int, action: Action
    ) -> None:
        """An answer or cancel that reached the state check."""
        phases = q.phases(t0, t1)
        check(isinstance(applied, bool), f"applied is {applied!r}")
        self.note(f"{action.kind} {'applied' if applied else 'stale'} on {'/'.join(sorted(phases))}")
        if applied:
            check(PENDING in phases, f"{action}: applied on {q.id} with phases {phases}")
            action.apply(q, envelope, t0, t1)
        else:
            self.counters.stale += 1
            check(phases != {PENDING}, f"{action}: not applied on {q.id}, pending and in time")
            if not q.terminal:
                check("overdue" in phases, f"{action}: {q.id} refused with phases {phases}")
                q.expire()
        self.same(q, envelope, str(action))
        if applied:
            self.counters.answered += action.kind == "answer"
            self.counters.cancelled += action.kind == "cancel"

    def race(
        self,
        q: Question,
        taps: list[tuple[Action, Any, dict[str, Any]]],
        t0: int,
        t1: int,
    ) -> None:
        """Concurrent taps on one question: at most one applies; every reply tells one story."""
        winners = [(a, env) for a, applied, env in taps if applied is True]
        self.note(f"race of {len(taps)}: {winners[0][0].kind if winners else 'nobody'} won")
        check(len(winners) <= 1, f"{len(winners)} taps applied on {q.id}: {[str(a) for a, _ in winners]}")
        for action, applied, _ in taps:
            check(isinstance(applied, bool), f"{action}: applied is {applied!r}")
        if winners:
            action, env = winners[0]
            self.tap(q, True, env, t0, t1, action)
        for action, applied, env in taps:
            if applied is not True:
                self.tap(q, False, env, t0, t1, action)

    def same(self, q: Question, envelope: dict[str, Any], path: str) -> None:
        """The envelope is the model's, and a terminal one is byte-for-byte the first seen."""
        expected = q.envelope()
        if envelope != expected:
            diff = {k: (envelope.get(k), expected.get(k)) for k in expected if envelope.get(k) != expected[k]}
            extra = set(envelope) - set(expected)
            raise ModelMismatch(f"{path}: envelope of {q.id} differs (got, model): {diff} extra: {extra}")
        if q.terminal:
            text = wire(envelope)
            first = self.terminal_wire.setdefault(q.id, text)
            check(text == first, f"{path}: terminal envelope of {q.id} changed:\n{first}\n{text}")


@dataclass
class Action:
    """One answer or cancel request that reaches the state check."""

    kind: str  # "answer" | "cancel"
    principal: str
    option: str = ""
    reason: str = ""

    def __str__(self) -> str:
        detail = self.option if self.kind == "answer" else repr(self.reason)
        return f"{self.kind} by {self.principal} ({detail})"

    def apply(self, q: Question, envelope: dict[str, Any], t0: int, t1: int) -> None:
        resolved = envelope.get("resolved_at")
        check(isinstance(resolved, str), f"{self}: applied without resolved_at")
        at = parse_ms(str(resolved))
        check(t0 <= at <= t1, f"{self}: resolved_at {at} outside [{t0}, {t1}]")
        check(at < q.expires_ms, f"{self}: applied at {at}, at or after the deadline {q.expires_ms}")
        q.resolved_ms = at
        if self.kind == "answer":
            q.state, q.answer = ANSWERED, (self.option, self.principal, at)
        else:
            q.state, q.cancellation = CANCELLED, (self.principal, self.reason or None)
