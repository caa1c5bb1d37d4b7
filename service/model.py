"""States, principals and the envelope: the one shape every path returns, built here alone."""

from __future__ import annotations

import enum
import functools
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from service.cache import Cache
from service.scripts import Fields

IDENTIFIER = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
OPTION_ID = re.compile(r"^[a-z0-9_-]{1,32}\Z")

MAX_PROMPT = 2000
MAX_LABEL = 80
MAX_REASON = 500
MIN_OPTIONS, MAX_OPTIONS = 2, 10
MAX_METADATA_BYTES = 8 * 1024
MAX_EXPIRES_IN = 2_592_000  # 30 days, in seconds
MAX_TOKEN_SECONDS = 10 * 365 * 86400  # the longest lifetime a token may be issued with


class State(enum.StrEnum):
    PENDING = "pending"
    ANSWERED = "answered"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not State.PENDING

    @classmethod
    def of(cls, value: str) -> State:
        """The state a stored field names: a dict lookup, a tenth of the enum call's 0.3 µs,
        paid by every envelope; an unknown name is a KeyError, as State(value) is a ValueError."""
        return _STATES[value]


_STATES = {state.value: state for state in State}


class Kind(enum.StrEnum):
    AGENT = "agent"
    USER = "user"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    id: str
    kind: Kind
    display_name: str = ""

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind.value, "display_name": self.display_name}


@dataclass(frozen=True, slots=True)
class Target:
    kind: str  # "user" | "room"
    id: str

    def public(self) -> dict[str, str]:
        return {self.kind: self.id}


class Question:
    """A question as stored: the fields a script returned, with typed access to what decides.
    Encoded (to_json, and the msgpack replies through `as_envelope`) it is its envelope, never
    its fields: not a dataclass, which msgspec would encode field by field."""

    __slots__ = ("fields",)

    def __init__(self, fields: Fields) -> None:
        self.fields = fields

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Question) and other.fields == self.fields

    __hash__ = None  # type: ignore[assignment]  # equal by mutable fields, as the dataclass was

    def __repr__(self) -> str:
        return f"Question({self.fields!r})"

    @property
    def id(self) -> str:
        return self.fields["id"]

    @property
    def state(self) -> State:
        return State.of(self.fields["state"])

    @property
    def asker(self) -> str:
        return self.fields["asker"]

    @property
    def target(self) -> Target:
        return Target(self.fields["to_kind"], self.fields["to_id"])

    def envelope(self) -> dict[str, Any]:
        return envelope(self.fields)


def timestamp(ms: int | str) -> str:
    """RFC 3339 UTC with milliseconds, from Redis TIME milliseconds."""
    seconds, millis = divmod(int(ms), 1000)
    return f"{_utc_seconds(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=4096)
def _utc_seconds(seconds: int) -> str:
    # strftime was a third of an envelope's CPU (6.4 -> 3.8 µs per answered envelope cached);
    # an envelope's moments, and a list page's, fall on few distinct seconds.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


# msgspec: an order of magnitude faster than the json module both ways, which shows in the
# requests/s of every route (docs/benchmarks.md). It keeps integers of any size exact.
_decode = msgspec.json.decode


def envelope(f: Fields) -> dict[str, Any]:
    """The envelope, from stored fields alone, so every path gives the same bytes."""
    state = State.of(f["state"])
    answer = None
    if state is State.ANSWERED:
        answer = {
            "option": f["ans_option"],
            "responder": f["ans_by"],
            "answered_at": timestamp(f["ans_ms"]),
        }
    cancellation = None
    if state is State.CANCELLED:
        cancellation = {"by": f["cancel_by"], "reason": f["cancel_reason"] or None}
    return {
        "id": f["id"],
        "state": state.value,
        "prompt": f["prompt"],
        "options": _decode(f["options"]),
        "to": {f["to_kind"]: f["to_id"]},
        "asker": f["asker"],
        "created_at": timestamp(f["created_ms"]),
        "expires_at": timestamp(f["expires_ms"]),
        "resolved_at": timestamp(f["resolved_ms"]) if state.terminal else None,
        "answer": answer,
        "cancellation": cancellation,
        "metadata": _decode(f["meta"]),
        "version": int(f["version"]),
    }


def canonical_json(value: Any) -> str:
    """Compact, key-sorted JSON: what the service stores and hashes."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)


_sorted_json = msgspec.json.Encoder(order="sorted")


def canonical_json_without_floats(value: Any) -> bytes:
    """canonical_json's very text, UTF-8, for values without floats: strings, integers, booleans,
    None, lists, string-keyed dicts, and msgspec.Raw pieces that are canonical already. Floats
    differ (json writes 1e+16, msgspec 1e16) and non-finite ones would become null, so whatever
    may hold them (metadata) goes through canonical_json. Three json.dumps calls were ~8 % of a
    create's CPU (docs/benchmarks.md); tests/test_canonical_json.py holds the two to the same text."""
    return _sorted_json.encode(value)


class RenderedEnvelopes:
    """The JSON of recent envelopes, made once each. A stored question changes only by its one
    transition, which raises `version` and writes the transition's call id (`tcall`), so one
    (id, version, tcall) is one envelope; the call id also tells apart a second transition after
    a failover lost the first. An agent polling its question, or the inbox listing open ones,
    reads the same envelope over and over: fetch went from 104.2 to 93.6 µs of CPU per request,
    a list page of 20 from 644.6 to 565.2 µs (bench.ab, docs/benchmarks.md). About 0.6 KiB per
    entry."""

    def __init__(self, size: int) -> None:
        self._recent: Cache[tuple[str, str, bytes]] = Cache(size)

    def json(self, question: Question) -> bytes:
        fields = question.fields
        stamp = fields["version"], fields.get("tcall", "")
        known = self._recent.get(fields["id"])
        if known is not None and known[:2] == stamp:
            return known[2]
        rendered = to_json(envelope(fields))
        self._recent.put(fields["id"], (*stamp, rendered))
        return rendered

    def __len__(self) -> int:
        return len(self._recent)


RENDERED = RenderedEnvelopes(4096)


def _encode_question(value: Any) -> Any:
    if isinstance(value, Question):
        return msgspec.Raw(RENDERED.json(value))
    raise TypeError(f"cannot encode {type(value).__name__}")


def as_envelope(value: Any) -> Any:
    """msgpack's `default`: a Question is packed as its envelope."""
    if isinstance(value, Question):
        return value.envelope()
    raise TypeError(f"cannot encode {type(value).__name__}")


_wire_json = msgspec.json.Encoder(enc_hook=_encode_question)


def to_json(value: Any) -> bytes:
    """The wire JSON of every reply: compact, UTF-8, keys in the order built; a Question in it
    is its envelope."""
    return _wire_json.encode(value)
