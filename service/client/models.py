"""Typed views of what the service sends back, and the parsing of what callers pass in."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, cast

from service.client.errors import InvalidArgument

State = Literal["pending", "answered", "expired", "cancelled"]
TerminalState = Literal["answered", "expired", "cancelled"]
TERMINAL_STATES: frozenset[str] = frozenset({"answered", "expired", "cancelled"})

# The service's own limits (service/model.py), repeated so the SDK never imports the server.
_OPTION_ID = re.compile(r"^[a-z0-9_-]{1,32}\Z")
MIN_OPTIONS, MAX_OPTIONS = 2, 10
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(?:\d+(?:\.\d+)?\s*[smhd]?\s*)+\Z", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True, slots=True)
class User:
    """Aim a question at one user: `to=User("alice")`."""

    id: str

    def wire(self) -> dict[str, str]:
        return {"user": self.id}

    def __str__(self) -> str:
        return f"user:{self.id}"


@dataclass(frozen=True, slots=True)
class Room:
    """Aim a question at a room, any member of which may answer: `to=Room("ops")`."""

    id: str

    def wire(self) -> dict[str, str]:
        return {"room": self.id}

    def __str__(self) -> str:
        return f"room:{self.id}"


Target = User | Room
Duration = str | int | float | timedelta


def parse_target(value: Target | str) -> Target:
    """A User or Room as is, or `"user:alice"` / `"room:ops"`."""
    if isinstance(value, User | Room):
        return value
    kind, sep, ident = str(value).partition(":")
    if sep and ident and kind == "user":
        return User(ident)
    if sep and ident and kind == "room":
        return Room(ident)
    raise InvalidArgument(f"target {value!r} must be user:ID or room:ID")


def parse_duration(value: Duration) -> float:
    """Seconds from `"10m"`, `"30s"`, `"2h"`, `"1d"`, `"1h30m"`, a number of seconds or a timedelta."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise InvalidArgument(f"duration {value!r} is not a number of seconds")
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION.match(value):
        seconds = sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in _DURATION_PART.findall(value))
    else:
        raise InvalidArgument(f"duration {value!r}: use seconds, or a string like 30s, 10m, 2h, 1d")
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"duration {value!r} must be a finite, non-negative time")
    return seconds


@dataclass(frozen=True, slots=True)
class Option:
    id: str
    label: str

    @classmethod
    def of(cls, value: Option | str | tuple[str, str] | Mapping[str, str]) -> Option:
        """An Option from itself, `(id, label)`, `{"id", "label"}`, or a string: a valid option id
        (`"deploy"`) is its own label; other text (`"Yes, deploy"`) gets a slug id (`yes-deploy`)."""
        if isinstance(value, Option):
            return value
        if isinstance(value, tuple | Mapping):
            return cls._given(value)
        if not isinstance(value, str):
            raise InvalidArgument(f"option {value!r} is not text, (id, label) or {{'id', 'label'}}")
        if _OPTION_ID.match(value):
            return cls(value, value)
        slug = re.sub(r"[^a-z0-9_-]+", "-", value.lower()).strip("-")[:32].strip("-")
        if not slug:
            raise InvalidArgument(f"option {value!r} has no letters or digits to make an id from")
        return cls(slug, value)

    @classmethod
    def _given(cls, value: tuple[str, str] | Mapping[str, str]) -> Option:
        """`(id, label)` or `{"id", "label"?}`: the id must be one the service takes."""
        given: Any = value  # checked here, whatever the caller's types said
        if isinstance(given, tuple):
            option_id, label = given if len(given) == 2 else (None, None)
        else:
            option_id = given.get("id")
            label = given.get("label", option_id)
        if not isinstance(option_id, str) or not _OPTION_ID.match(option_id) or not isinstance(label, str):
            raise InvalidArgument(
                f"option {value!r}: give (id, label) or {{'id', 'label'}} with an id of 1-32 of a-z 0-9 _ -"
            )
        return cls(option_id, label or option_id)

    def wire(self) -> dict[str, str]:
        return {"id": self.id, "label": self.label}


def timestamp(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))


@dataclass(frozen=True, slots=True)
class Answer:
    option: str
    responder: str
    answered_at: datetime


@dataclass(frozen=True, slots=True)
class Cancellation:
    by: str
    reason: str | None


@dataclass(frozen=True, slots=True)
class Envelope:
    """One question as the service reports it (every route returns this same shape)."""

    id: str
    state: State
    prompt: str
    options: tuple[Option, ...]
    to: Target
    asker: str
    created_at: datetime
    expires_at: datetime
    resolved_at: datetime | None
    answer: Answer | None
    cancellation: Cancellation | None
    metadata: dict[str, Any] | None
    version: int
    raw: dict[str, Any]

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Envelope:
        answer = raw.get("answer")
        cancellation = raw.get("cancellation")
        (kind, ident), *_ = raw["to"].items()
        return cls(
            id=raw["id"],
            state=cast(State, raw["state"]),
            prompt=raw["prompt"],
            options=tuple(Option.of(o) for o in raw["options"]),
            to=User(ident) if kind == "user" else Room(ident),
            asker=raw["asker"],
            created_at=datetime.fromisoformat(raw["created_at"]),
            expires_at=datetime.fromisoformat(raw["expires_at"]),
            resolved_at=timestamp(raw.get("resolved_at")),
            answer=None
            if answer is None
            else Answer(answer["option"], answer["responder"], datetime.fromisoformat(answer["answered_at"])),
            cancellation=None
            if cancellation is None
            else Cancellation(cancellation["by"], cancellation.get("reason")),
            metadata=raw.get("metadata"),
            version=int(raw["version"]),
            raw=dict(raw),
        )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def result(self) -> Result:
        """The terminal outcome; InvalidArgument while the question is still pending."""
        if not self.terminal:
            raise InvalidArgument(f"question {self.id} is still pending")
        assert self.resolved_at is not None  # the service sets it on every terminal envelope
        return Result(
            id=self.id,
            state=cast(TerminalState, self.state),
            option=self.answer.option if self.answer else None,
            answered_by=self.answer.responder if self.answer else None,
            resolved_at=self.resolved_at,
            cancelled_by=self.cancellation.by if self.cancellation else None,
            cancel_reason=self.cancellation.reason if self.cancellation else None,
            question=self,
        )


@dataclass(frozen=True, slots=True)
class Result:
    """How a question ended: answered (with `option` and `answered_by`), expired or cancelled."""

    id: str
    state: TerminalState
    option: str | None
    answered_by: str | None
    resolved_at: datetime
    cancelled_by: str | None
    cancel_reason: str | None
    question: Envelope

    def answered(self, option: str | None = None) -> bool:
        """True when answered (with `option`, when one is named)."""
        return self.state == "answered" and (option is None or self.option == option)

    @property
    def expired(self) -> bool:
        return self.state == "expired"

    @property
    def cancelled(self) -> bool:
        return self.state == "cancelled"

    @property
    def envelope(self) -> dict[str, Any]:
        """The raw terminal envelope, as the service sent it."""
        return self.question.raw


@dataclass(frozen=True, slots=True)
class Outcome:
    """The reply to answer and cancel: `applied` is False when the question had already ended
    by something else; a retry of a request whose first try applied (its reply lost) is
    True again, since the SDK sends every answer and cancel with an Idempotency-Key."""

    applied: bool
    question: Envelope


@dataclass(frozen=True, slots=True)
class Page:
    items: tuple[Envelope, ...]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class WaitManyResult:
    """The reply to wait_many: every question's envelope, and whether any/all had ended."""

    items: tuple[Envelope, ...]
    mode: Literal["any", "all"]
    condition_met: bool

    @property
    def terminal(self) -> tuple[Envelope, ...]:
        return tuple(item for item in self.items if item.terminal)


OptionLike = Option | str | tuple[str, str] | Mapping[str, str]


def options_wire(options: Sequence[OptionLike]) -> list[dict[str, str]]:
    if isinstance(options, str):
        raise InvalidArgument("options must be a list of options, not one string")
    if not MIN_OPTIONS <= len(options) <= MAX_OPTIONS:
        raise InvalidArgument(f"give {MIN_OPTIONS} to {MAX_OPTIONS} options, not {len(options)}")
    return [Option.of(o).wire() for o in options]
