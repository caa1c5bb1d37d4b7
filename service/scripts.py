"""Loads lua/, registers each script once per client, and maps every script reply to a Python result.

Each script's header is the contract: the ``KEYS[i] name`` and ``ARGV[i] name`` lines fix the
order, and callers pass keys and arguments *by those names*, so the order lives in one place
(the Lua file) and cannot drift from the Python side.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import importlib.resources
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from service.coalesce import Coalescer, Durability
from service.errors import Unavailable
from service.redis_client import is_cluster, refused_for_now

if TYPE_CHECKING:
    from service.metrics import Metrics

SCRIPT_NAMES = (
    "create", "answer", "cancel", "expire", "expire_many", "purge",
    "deliver_enqueue", "deliver_claim", "deliver_settle", "deliver_replay",
    "webhook_add", "webhook_rotate", "channel_put",
)  # fmt: skip
# The transitions that a QS_WAIT_REPLICAS confirmation follows.
CONFIRMED_SCRIPTS = frozenset({"answer", "cancel"})
# The argument that names the publish command; LuaScript.args fills it in when left out.
PUBLISH_ARG = "publish"
_INCLUDE = re.compile(r'^--@include "([a-z_]+)"\s*$')
_HEADER_NAME = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\]\s+(.+?)(?:\s{2,}|$)")
SHEBANG = "#!lua"


class ScriptMisuse(RuntimeError):
    """A script refused its input with an error reply: a bug in the caller, not a user error."""


class Code(enum.StrEnum):
    CREATED = "created"
    REPLAYED = "replayed"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    BAD_DEADLINE = "bad_deadline"
    APPLIED = "applied"
    STALE = "stale"
    PENDING = "pending"
    NOT_FOUND = "not_found"
    NOT_ELIGIBLE = "not_eligible"
    NOT_ASKER = "not_asker"
    UNKNOWN_OPTION = "unknown_option"
    FULL = "full"
    ROOMS_NEEDED = "rooms_needed"


Fields = dict[str, str]


@dataclass(frozen=True, slots=True)
class Reply:
    """A script's outcome: a code, the question's fields when returned, or a single value."""

    code: Code
    fields: Fields | None = None
    value: str | None = None
    expired_now: bool = False  # a late answer or cancel expired the question itself
    again: bool = False  # a re-run of the call that made the transition reports it again


def interpret(raw: Any) -> Reply:
    """The one place where a script's return value becomes a Python result."""
    if isinstance(raw, int):
        return Reply(Code.APPLIED if raw else Code.STALE)
    code = Code(raw[0])
    if len(raw) < 2:
        return Reply(code)
    payload = raw[1]
    if isinstance(payload, list):
        note = raw[2] if len(raw) > 2 else None
        fields = pairs_to_fields(payload)
        return Reply(code, fields=fields, expired_now=note == "expired_now", again=note == "again")
    return Reply(code, value=str(payload))


def pairs_to_fields(flat: Sequence[str]) -> Fields:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def lua_dir() -> Path:
    """Scripts ship inside the wheel as service/lua; a source checkout keeps them in ./lua."""
    packaged = Path(str(importlib.resources.files("service"))) / "lua"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "lua"


def expand(name: str, directory: Path | None = None) -> str:
    """A script's source with every ``--@include "x"`` replaced by includes/x.lua, once each."""
    base = directory or lua_dir()
    seen: set[str] = set()

    def inline(path: Path, stack: tuple[str, ...]) -> list[str]:
        out = []
        for line in path.read_text().splitlines():
            match = _INCLUDE.match(line)
            if not match:
                out.append(line)
                continue
            include = match.group(1)
            if include in stack:
                raise ValueError(f"include cycle: {' -> '.join((*stack, include))}")
            if include not in seen:
                seen.add(include)
                out.extend(inline(base / "includes" / f"{include}.lua", (*stack, include)))
        return out

    return "\n".join(inline(base / f"{name}.lua", (name,))) + "\n"


def header_names(source: str, kind: str) -> tuple[str, ...]:
    """The names of KEYS or ARGV in header order, checked to be numbered 1..n."""
    found: dict[int, str] = {}
    for line in source.splitlines():
        match = _HEADER_NAME.match(line)
        if match and match.group(1) == kind:
            found[int(match.group(2))] = match.group(3).strip()
    if sorted(found) != list(range(1, len(found) + 1)):
        raise ValueError(f"{kind} in the header are not numbered 1..n: {sorted(found)}")
    return tuple(found[i] for i in range(1, len(found) + 1))


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str
    key_names: tuple[str, ...]
    arg_names: tuple[str, ...]
    sha: str

    @classmethod
    def load(cls, name: str, *, shebang: bool = True, directory: Path | None = None) -> LuaScript:
        source = expand(name, directory)
        if not shebang and source.startswith(SHEBANG):
            # fakeredis refuses the shebang line; real Redis needs it to refuse under OOM up front.
            source = source.split("\n", 1)[1]
        sha = hashlib.sha1(source.encode()).hexdigest()
        return cls(name, source, header_names(source, "KEYS"), header_names(source, "ARGV"), sha)

    def keys(self, named: Mapping[str, str]) -> list[str]:
        """Keys in header order; trailing keys the caller leaves out are optional."""
        if len(named) == len(self.key_names):
            try:  # the hot path: every name given, so none can be unknown either
                return [named[n] for n in self.key_names]
            except KeyError:
                pass
        unknown = set(named) - set(self.key_names)
        if unknown:
            raise KeyError(f"{self.name}.lua takes no keys named {sorted(unknown)}")
        ordered = [named.get(n) for n in self.key_names]
        while ordered and ordered[-1] is None:
            ordered.pop()
        if None in ordered:
            raise KeyError(f"{self.name}.lua misses a key: {self.key_names[ordered.index(None)]}")
        return [k for k in ordered if k is not None]

    def args(self, named: Mapping[str, str | int], publish: str = "PUBLISH") -> list[str | int]:
        """Arguments in header order. A script that publishes takes a `publish` argument; the
        caller may leave it out and `publish` fills it in (see Scripts)."""
        if len(named) == len(self.arg_names):
            try:
                return [named[n] for n in self.arg_names]
            except KeyError:
                pass
        if len(named) + 1 == len(self.arg_names) and PUBLISH_ARG not in named:
            try:  # the hot path of the transitions: everything but `publish` given
                return [publish if n == PUBLISH_ARG else named[n] for n in self.arg_names]
            except KeyError:
                pass
        if PUBLISH_ARG in self.arg_names and PUBLISH_ARG not in named:
            named = {**named, PUBLISH_ARG: publish}
        if set(named) != set(self.arg_names):
            missing = set(self.arg_names) - set(named)
            extra = set(named) - set(self.arg_names)
            raise KeyError(f"{self.name}.lua arguments: missing {missing}, unknown {extra}")
        return [named[n] for n in self.arg_names]


def refusal(name: str, exc: ResponseError) -> Exception:
    """Redis refusing writes (out of memory, read-only replica, ...) is an outage, not misuse."""
    if refused_for_now(exc):
        return Unavailable(f"Redis refused the call: {exc}")
    return ScriptMisuse(f"{name}.lua: {exc}")


# Calls per pipeline of a call_many: big enough to keep per-batch costs small, small enough that
# Redis starts on the first while Python packs the rest (a 100,000-question sweep: docs/benchmarks.md).
CHUNK = 1000
# The same for call_many_variadic, whose calls carry up to EXPIRE_MANY_BATCH items each.
VARIADIC_CHUNK = 10
# A variadic call: its named keys and arguments, then its items' keys and arguments.
VariadicCall = tuple[Mapping[str, str], Mapping[str, str | int], Sequence[str], Sequence[str | int]]


class Scripts:
    """Every script called by SHA through one coalescer; NOSCRIPT reloads it by itself.

    On a Redis Cluster the transitions publish with SPUBLISH (sharded pub/sub, slot-checked
    like the keys), on one Redis with PUBLISH: the `publish` argument is filled in by
    LuaScript.args, so callers never name it. With `durability`, answer and cancel are followed by a WAIT."""

    def __init__(self, redis: Redis, *, shebang: bool = True, durability: Durability | None = None) -> None:
        self.redis = redis
        self.lua = {name: LuaScript.load(name, shebang=shebang) for name in SCRIPT_NAMES}
        self.cluster = is_cluster(redis)
        self.publish = "SPUBLISH" if self.cluster else "PUBLISH"
        self.coalescer = Coalescer(redis, durability=durability)
        self._confirmed = CONFIRMED_SCRIPTS if durability is not None and durability.replicas else frozenset()
        self.metrics: Metrics | None = None  # set by the app: outcomes, durations, errors

    def _submit(
        self, name: str, keys: Mapping[str, str], args: Mapping[str, str | int]
    ) -> asyncio.Future[Any]:
        script = self.lua[name]
        return self.coalescer.evalsha(
            script.sha,
            script.source,
            script.keys(keys),
            script.args(args, self.publish),
            confirm=name in self._confirmed,
        )

    async def call(self, name: str, keys: Mapping[str, str], args: Mapping[str, str | int]) -> Reply:
        started = time.perf_counter()
        try:
            reply = interpret(await self._submit(name, keys, args))
        except ResponseError as exc:
            raise self._failed(name, refusal(name, exc)) from exc
        except (RedisError, OSError) as exc:
            self._failed(name, exc)
            raise
        if self.metrics is not None:
            self.metrics.script_done(name, args, reply, time.perf_counter() - started)
        return reply

    async def call_many(
        self, name: str, calls: Sequence[tuple[Mapping[str, str], Mapping[str, str | int]]]
    ) -> list[Reply]:
        """Many calls of one script, each getting its own Reply."""
        started = time.perf_counter()
        raws = await self._submitted(name, len(calls), lambda i: self._submit(name, *calls[i]), CHUNK)
        replies = [interpret(raw) for raw in raws]
        if self.metrics is not None:
            elapsed = time.perf_counter() - started
            for (_, args), reply in zip(calls, replies, strict=True):
                self.metrics.script_done(name, args, reply, elapsed)
        return replies

    async def call_many_variadic(self, name: str, calls: Sequence[VariadicCall]) -> list[list[str]]:
        """Many calls of a script that takes a list of items after its named keys and arguments
        (expire_many: a question after another); each call's reply is one code per item."""
        script = self.lua[name]

        def submit(i: int) -> asyncio.Future[Any]:
            keys, args, more_keys, more_args = calls[i]
            return self.coalescer.evalsha(
                script.sha,
                script.source,
                [*script.keys(keys), *more_keys],
                [*script.args(args, self.publish), *more_args],
            )

        started = time.perf_counter()
        raws = await self._submitted(name, len(calls), submit, VARIADIC_CHUNK)
        codes = [[str(code) for code in raw] for raw in raws]
        if self.metrics is not None:
            elapsed = time.perf_counter() - started
            for call_codes in codes:
                self.metrics.codes_done(name, call_codes, elapsed)
        return codes

    async def _submitted(
        self, name: str, count: int, submit: Callable[[int], asyncio.Future[Any]], chunk: int
    ) -> list[Any]:
        """The replies of `count` calls, submitted `chunk` at a time: one event-loop turn per chunk
        lets the coalescer send each chunk while the next is packed, so Redis runs one while
        Python builds the next (a sweep of 16,000 overdue questions is otherwise one batch that
        Python packs, then Redis runs, then Python reads, each waiting on the other). Gathering the
        futures themselves (not a coroutine per call) spares a task per call on sweeps."""
        futures: list[asyncio.Future[Any]] = []
        try:
            for first in range(0, count, chunk):
                if first:
                    await asyncio.sleep(0)  # the coalescer flushes the chunk before it
                futures += [submit(i) for i in range(first, min(count, first + chunk))]
        except asyncio.CancelledError:
            for future in futures:  # nobody will read them: no "exception never retrieved"
                future.cancel()
            raise
        try:
            return await asyncio.gather(*futures)
        except ResponseError as exc:
            raise self._failed(name, refusal(name, exc)) from exc
        except (RedisError, OSError) as exc:
            self._failed(name, exc)
            raise

    def _failed(self, name: str, exc: Exception) -> Exception:
        """Count a failed call for /metrics; returns `exc` for the caller to raise."""
        if self.metrics is not None:
            self.metrics.script_failed(name, exc)
        return exc

    def shas(self) -> list[str]:
        return [s.sha for s in self.lua.values()]

    async def loaded(self) -> bool:
        return all(await self.redis.script_exists(*self.shas()))

    async def load_all(self) -> None:
        for script in self.lua.values():
            await self.redis.script_load(script.source)

    async def aclose(self) -> None:
        await self.coalescer.aclose()
