"""The question store: one typed method per script; Redis details stop here."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import itertools
import re
import secrets
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from service.keys import BUCKETS, QUESTION_ID, Keys, bucket_of, idempotency_bucket, new_question_id
from service.model import MAX_EXPIRES_IN, Question, Target
from service.scripts import Code, Reply, Scripts, VariadicCall
from service.settings import Settings

_CURSOR = re.compile(r"^[0-9]{13}:[0-9a-f]{25}\Z")
MAX_SCAN_ROUNDS = 8
# Questions per expire_many call (docs/benchmarks.md: one call per question spent more of Redis'
# time in calling the script than in expiring).
EXPIRE_MANY_BATCH = 100


class BadCursor(ValueError):
    """A list cursor that this service did not issue."""


_CALL_PREFIX = secrets.token_hex(5)
_call_numbers = itertools.count(1)


def new_call_id() -> str:
    """Unique per call: a random per-process prefix (40 bits) and a counter. Cheaper than
    drawing fresh random bytes per call, which cost a system call on the hot path."""
    return f"{_CALL_PREFIX}{next(_call_numbers):x}"


def keyed_call_id(*request: str) -> str:
    """The call id of a request the client may send again (its principal, operation,
    Idempotency-Key and body): the same request gets the same id, so a retry whose first try
    made the transition is told `applied` again. The ':' keeps it apart from new_call_id's hex."""
    return "k:" + hashlib.sha256("\0".join(request).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class NewQuestion:
    asker: str
    target: Target
    prompt: str
    options_json: str
    option_ids: Sequence[str]
    metadata_json: str
    expires_in_ms: int  # 0 when expires_at_ms is used
    expires_at_ms: int  # 0 when expires_in_ms is used
    digest: str  # of the request, for Idempotency-Key replays
    webhook_url: str = ""  # the question's own webhook, signed with webhook_secret
    webhook_secret: str = ""


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Question]
    next_cursor: str | None


def encode_cursor(member: str) -> str:
    return base64.urlsafe_b64encode(member.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        member = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise BadCursor(cursor) from exc
    if not _CURSOR.match(member):
        raise BadCursor(cursor)
    return member


def _with_call_ids(question_ids: Sequence[str]) -> list[str | int]:
    """expire_many's two arguments per question: its id, and a call id of its own."""
    args: list[str | int] = []
    for question_id in question_ids:
        args += (question_id, new_call_id())
    return args


class QuestionStore:
    def __init__(self, redis: Redis, scripts: Scripts, settings: Settings) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = Keys(settings.key_prefix)
        self.retention_ms = settings.retention_seconds * 1000
        self.idempotency_ttl_ms = settings.idempotency_ttl_seconds * 1000
        self.outbox_maxlen = settings.outbox_maxlen
        # One bucket's share of an agent's cap: a create sees only its own bucket (one slot).
        self.asker_bucket_cap = -(-settings.questions_per_agent // BUCKETS)
        self.sweep_batch = settings.sweep_batch
        # An index outlives every question in it: longest deadline + retention + a day.
        self.index_ttl_ms = (MAX_EXPIRES_IN + settings.retention_seconds + 86400) * 1000

    def _transition_keys(self, question_id: str) -> dict[str, str]:
        k = self.keys.for_question(question_id)
        return {
            "question": k.question,
            "deadline marker": k.deadline_marker,
            "deadlines": k.deadlines,
            "purge": k.purge,
            "channel": k.channel,
            "outbox": k.outbox,
            "stats": k.stats,
        }

    def _tap_keys(self, question_id: str) -> dict[str, str]:
        """Answer and cancel also remember stale call ids, to count a stale tap once."""
        stale_calls = self.keys.for_question(question_id).stale_calls
        return {**self._transition_keys(question_id), "stale calls": stale_calls}

    def channel(self, question_id: str) -> str:
        return self.keys.for_question(question_id).channel

    async def create(self, new: NewQuestion, idempotency_key: str | None) -> Reply:
        """Create a question. With an idempotency key, a replay returns Code.REPLAYED and the id."""
        bucket = None if idempotency_key is None else idempotency_bucket(new.asker, idempotency_key)
        question_id = new_question_id(bucket)
        b = bucket_of(question_id)
        k = self.keys.for_question(question_id)
        keys = {
            "question": k.question,
            "deadline marker": k.deadline_marker,
            "deadlines": k.deadlines,
            "outbox": k.outbox,
            "stats": k.stats,
            "asker index": self.keys.asker_index(b, new.asker),
            "target index": self.keys.target_index(b, new.target.kind, new.target.id),
        }
        if idempotency_key is not None:
            keys["idempotency key"] = self.keys.idempotency(b, new.asker, idempotency_key)
        args: dict[str, str | int] = {
            "id": question_id,
            "call id": new_call_id(),
            "asker": new.asker,
            "to kind": new.target.kind,
            "to id": new.target.id,
            "prompt": new.prompt,
            "options": new.options_json,
            "option ids": "|" + "|".join(new.option_ids) + "|",
            "metadata": new.metadata_json,
            "expires in": new.expires_in_ms,
            "expires at": new.expires_at_ms,
            "longest lifetime": MAX_EXPIRES_IN * 1000,
            "request digest": new.digest,
            "idempotency ttl": self.idempotency_ttl_ms,
            "index ttl": self.index_ttl_ms,
            "outbox maxlen": self.outbox_maxlen,
            "webhook url": new.webhook_url,
            "webhook secret": new.webhook_secret,
            "asker cap": self.asker_bucket_cap,
        }
        return await self.scripts.call("create", keys, args)

    async def read(self, question_id: str) -> Question | None:
        """The question as it stands, expired on the spot when its deadline has passed."""
        if not QUESTION_ID.match(question_id):
            return None
        reply = await self.scripts.call(
            "expire", self._transition_keys(question_id), self._expire_args(question_id)
        )
        return None if reply.fields is None else Question(reply.fields)

    async def read_many(self, question_ids: Sequence[str]) -> list[Question | None]:
        calls = [(self._transition_keys(q), self._expire_args(q)) for q in question_ids]
        replies = await self.scripts.call_many("expire", calls)
        return [None if r.fields is None else Question(r.fields) for r in replies]

    async def expire_many(self, question_ids: Sequence[str]) -> list[Code]:
        """Expire whichever of these are overdue, EXPIRE_MANY_BATCH of a bucket per script call;
        the sweeper and the keyspace listener use it. A code per id, in order: APPLIED for each
        this call expired (also when a retry of the call reports it again)."""
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i, question_id in enumerate(question_ids):
            by_bucket[bucket_of(question_id)].append(i)
        calls: list[VariadicCall] = []
        order: list[int] = []
        args: dict[str, str | int] = {"retention": self.retention_ms, "outbox maxlen": self.outbox_maxlen}
        for b, positions in by_bucket.items():
            bucket_keys = {
                "deadlines": self.keys.deadlines(b),
                "purge": self.keys.purge(b),
                "outbox": self.keys.outbox(b),
                "stats": self.keys.stats(b),
            }
            for first in range(0, len(positions), EXPIRE_MANY_BATCH):
                batch = positions[first : first + EXPIRE_MANY_BATCH]
                ids = [question_ids[i] for i in batch]
                calls.append((bucket_keys, args, self._expiry_keys(ids), _with_call_ids(ids)))
                order += batch
        codes: list[Code] = [Code.PENDING] * len(question_ids)
        replies = await self.scripts.call_many_variadic("expire_many", calls)
        for i, code in zip(order, (code for reply in replies for code in reply), strict=True):
            codes[i] = Code.APPLIED if code == "again" else Code(code)
        return codes

    def _expiry_keys(self, question_ids: Sequence[str]) -> list[str]:
        """expire_many's three keys per question: the hash, the deadline marker, the channel."""
        keys: list[str] = []
        for question_id in question_ids:
            k = self.keys.for_question(question_id)
            keys += (k.question, k.deadline_marker, k.channel)
        return keys

    def _expire_args(self, question_id: str) -> dict[str, str | int]:
        return {
            "id": question_id,
            "call id": new_call_id(),
            "retention": self.retention_ms,
            "outbox maxlen": self.outbox_maxlen,
        }

    async def answer(
        self, question_id: str, responder: str, option: str, rooms: Sequence[str] | None, call_id: str
    ) -> Reply:
        """`rooms`: the responder's rooms, read just before; eligibility is decided in the script.
        None when the caller does not know the question's target: a room question then replies
        ROOMS_NEEDED with its room, and changes nothing."""
        args: dict[str, str | int] = {
            "id": question_id,
            "responder": responder,
            "option": option,
            "call id": call_id,
            "responder rooms": "?" if rooms is None else "|" + "|".join(rooms) + "|",
            "retention": self.retention_ms,
            "outbox maxlen": self.outbox_maxlen,
        }
        return await self.scripts.call("answer", self._tap_keys(question_id), args)

    async def cancel(self, question_id: str, by: str, reason: str, *, any_asker: bool, call_id: str) -> Reply:
        args: dict[str, str | int] = {
            "id": question_id,
            "by": by,
            "any asker": "1" if any_asker else "0",
            "reason": reason,
            "call id": call_id,
            "retention": self.retention_ms,
            "outbox maxlen": self.outbox_maxlen,
        }
        return await self.scripts.call("cancel", self._tap_keys(question_id), args)

    # -- sweeping -------------------------------------------------------------------------------

    async def redis_time_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def due(self, index: Callable[[int], str], now_ms: int) -> list[str]:
        """Ids whose score in a bucket index (deadlines or purge) is <= now, a batch per bucket."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in range(BUCKETS):
                pipe.zrange(index(b), "-inf", now_ms, byscore=True, offset=0, num=self.sweep_batch)
            batches = await pipe.execute()
        return [question_id for batch in batches for question_id in batch]

    async def purge_many(self, question_ids: Sequence[str]) -> int:
        """Remove terminal questions whose retention is over, with their index entries."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for q in question_ids:
                pipe.hmget(self.keys.for_question(q).question, "asker", "to_kind", "to_id")
            heads = await pipe.execute()
        calls = []
        for question_id, (asker, to_kind, to_id) in zip(question_ids, heads, strict=True):
            b = bucket_of(question_id)
            if asker is None:
                await self.redis.zrem(self.keys.purge(b), question_id)
                continue
            keys = {
                "question": self.keys.for_question(question_id).question,
                "purge": self.keys.purge(b),
                "asker index": self.keys.asker_index(b, asker),
                "target index": self.keys.target_index(b, to_kind, to_id),
            }
            calls.append((keys, {"id": question_id}))
        replies = await self.scripts.call_many("purge", calls)
        return sum(r.code is Code.APPLIED for r in replies)

    # -- listing --------------------------------------------------------------------------------

    def index_keys(self, asker: str | None, targets: Sequence[Target]) -> list[str]:
        keys = []
        for b in range(BUCKETS):
            if asker is not None:
                keys.append(self.keys.asker_index(b, asker))
            keys.extend(self.keys.target_index(b, t.kind, t.id) for t in targets)
        return keys

    async def page(
        self,
        index_keys: Sequence[str],
        *,
        cursor: str | None,
        limit: int,
        keep: Callable[[Question], bool],
    ) -> Page:
        """Newest first across indexes; members sort as '<created_ms>:<id>', so pages are stable
        under concurrent inserts (new members sort above every cursor already handed out)."""
        upper = "+" if cursor is None else "(" + decode_cursor(cursor)
        items: list[Question] = []
        live = list(index_keys)
        for _ in range(MAX_SCAN_ROUNDS):
            want = limit - len(items) + 1
            candidates, live = await self._newest(live, upper, want)
            if not candidates:
                return Page(items, None)
            questions = await self.read_many([m.split(":", 1)[1] for m in candidates])
            for member, question in zip(candidates, questions, strict=True):
                if question is None or not keep(question):
                    continue
                if len(items) == limit:
                    return Page(items, encode_cursor(upper[1:]))
                items.append(question)
                upper = "(" + member
            upper = "(" + candidates[-1]
            if not live:
                return Page(items, None)
        return Page(items, encode_cursor(upper[1:]))

    async def _newest(self, keys: Sequence[str], upper: str, want: int) -> tuple[list[str], list[str]]:
        """The `want` newest members below `upper` over all keys, and the keys that may hold
        more below the last of them."""
        coalescer = self.scripts.coalescer  # one batch with the page's reads, not a pooled pipeline
        newest = (coalescer.read("ZRANGE", key, upper, "-", "BYLEX", "REV", "LIMIT", 0, want) for key in keys)
        results: list[list[str]] = await asyncio.gather(*newest)
        merged = sorted({m for found in results for m in found}, reverse=True)[:want]
        if not merged:
            return [], []
        cutoff = merged[-1]
        live = [
            key
            for key, found in zip(keys, results, strict=True)
            if len(found) == want or (found and found[-1] < cutoff)
        ]
        return merged, live
