"""A consumer of the bucket outboxes: one consumer group per kind of work, at-least-once.

The transition scripts append every committed event to their bucket's outbox stream in the same
script as the state change, so an event exists if and only if its transition committed. Each kind
of consumer (the per-principal event relay, the webhook fan-out) reads the outboxes through its own
consumer group, processes what one read returned (any number of outboxes), and only then
acknowledges all of it in one round trip; entries a dead consumer left unacknowledged are taken
over with XAUTOCLAIM once idle long enough. Processing must be idempotent, because an entry can be
handled twice.

An entry no retry can process (not written by the scripts: an operator's XADD, a bug) must not
hold back the events read with it: a read that fails on an entry's content (POISON) is processed
again one entry at a time, and only the entries that fail alone are skipped (logged with their
ids, counted in `qs_outbox_skipped`) and acknowledged with the rest. Any other failure (Redis
unreachable or refusing, a failover, a WRONGTYPE an operator can fix) acknowledges nothing: the
read comes back, whole, after RECLAIM_IDLE_MS.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import DataError, RedisError, ResponseError

from service.backoff import Backoff, keep_running
from service.coalesce import exchange
from service.keys import BUCKETS, Keys
from service.redis_client import is_cluster
from service.scripts import ScriptMisuse

log = logging.getLogger(__name__)
# What an entry's own content can raise, the same on every retry: a missing field, JSON that does
# not decode, a value redis-py cannot send, a script refusing its arguments as misuse. Only these
# make a read go one entry at a time; an outage must never get an event skipped.
POISON = (KeyError, ValueError, TypeError, IndexError, DataError, ScriptMisuse)
Entries = Sequence[tuple[str, dict[str, str]]]
Read = Sequence[tuple[str, Entries]]  # (outbox, its entries) for each outbox one read returned
RECLAIM_IDLE_MS = 30_000


class OutboxConsumer(abc.ABC):
    """Subclasses name their `group` and implement `process`."""

    group = ""
    label = "outbox consumer"

    def __init__(self, redis: Redis, keys: Keys, *, blocking: Redis | None = None) -> None:
        self.redis = redis
        self.blocking = blocking or redis
        self.keys = keys
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.reclaim_idle_ms = RECLAIM_IDLE_MS
        self.handled = 0
        self.skipped = 0  # entries that failed to process alone, acknowledged without effect
        self.stopping = False  # checked each read: see backoff.stop_tasks

    @abc.abstractmethod
    async def process(self, read: Read) -> None:
        """Handle every entry of one read, idempotently. Entries trimmed away before the read
        come with no fields."""

    async def consume(self, read: Read) -> None:
        """Process a read, then acknowledge all of it: only after, since an XACK sent with writes
        that fail would drop their events."""
        try:
            await self.process(read)
        except POISON:
            log.warning("%s: a read of %d entries failed; processing them one by one", self.label, size(read))
            await self._process_one_by_one(read)
        await run_all(
            self.redis, [("XACK", outbox, self.group, *(i for i, _ in entries)) for outbox, entries in read]
        )
        self.handled += size(read)

    async def _process_one_by_one(self, read: Read) -> None:
        for outbox, entries in read:
            for entry in entries:
                try:
                    await self.process([(outbox, [entry])])
                except POISON:
                    self.skipped += 1
                    log.exception(
                        "%s: skipped outbox entry %s %s (fields %s): it fails on its own",
                        self.label, outbox, entry[0], sorted(entry[1]),
                    )  # fmt: skip

    async def ensure_groups(self) -> None:
        for b in range(BUCKETS):
            await self.ensure_group(b)

    async def ensure_group(self, b: int) -> None:
        try:
            await self.redis.xgroup_create(self.keys.outbox(b), self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        """Consume until stopped or cancelled; after any failure, log it and go on."""
        await keep_running(self.label, self._consume_forever, lambda: self.stopping)

    async def _consume_forever(self, backoff: Backoff) -> None:
        await self.ensure_groups()
        if is_cluster(self.blocking):
            await self._consume_buckets_forever()
            return
        streams: dict[Any, Any] = {self.keys.outbox(b): ">" for b in range(BUCKETS)}
        next_reclaim = 0.0
        loop = asyncio.get_running_loop()
        while not self.stopping:
            if loop.time() >= next_reclaim:
                await self.reclaim()
                next_reclaim = loop.time() + self.reclaim_idle_ms / 3000
            read: Any = await self.blocking.xreadgroup(
                self.group, self.consumer, streams, count=500, block=1000
            )
            backoff.succeeded()
            if read:
                await self.consume(read)

    async def _consume_buckets_forever(self) -> None:
        """Cluster: one blocking reader per bucket (each outbox is its own slot), and a reclaimer."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._reclaim_forever())
            for b in range(BUCKETS):
                group.create_task(self._consume_bucket_forever(b))

    async def _consume_bucket_forever(self, b: int) -> None:
        backoff = Backoff(f"{self.label}, bucket {b}")
        streams: dict[Any, Any] = {self.keys.outbox(b): ">"}
        while not self.stopping:
            try:
                read: Any = await self.blocking.xreadgroup(
                    self.group, self.consumer, streams, count=500, block=1000
                )
                if read:
                    await self.consume(read)
            except RedisError as exc:
                await self._group_again_if_lost(exc, [b])
                await backoff.failed(exc)
                continue
            backoff.succeeded()

    async def _reclaim_forever(self) -> None:
        backoff = Backoff(f"{self.label}, reclaim")
        while not self.stopping:
            try:
                await self.reclaim()
            except RedisError as exc:
                await self._group_again_if_lost(exc, range(BUCKETS))
                await backoff.failed(exc)
                continue
            backoff.succeeded()
            await asyncio.sleep(self.reclaim_idle_ms / 3000)

    async def _group_again_if_lost(self, exc: RedisError, buckets: Iterable[int]) -> None:
        """An outbox lost with its group (a primary restarted without persistence, a FLUSHALL;
        the next create's XADD makes the stream again, without the group): NOGROUP on every read
        until the group is made again. On one Redis the error ends the loop, and keep_running's
        restart makes every group; on a cluster each bucket's loop goes on, so it is done here."""
        if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
            for b in buckets:
                await self.ensure_group(b)

    async def reclaim(self) -> None:
        """Take over what a dead consumer of this group left unacknowledged for too long."""
        for b in range(BUCKETS):
            outbox = self.keys.outbox(b)
            claimed = await self.redis.xautoclaim(
                outbox, self.group, self.consumer, self.reclaim_idle_ms, "0-0", count=500
            )
            if claimed[1]:
                await self.consume([(outbox, claimed[1])])


def size(read: Read) -> int:
    return sum(len(entries) for _, entries in read)


# Commands per round trip of run_all. One round trip of a few million (the events of one read for
# a 10,000-member room) outlived the socket timeout; the client's Retry re-sent all of it, and each
# re-send appended every event again (four copies, 2026-12-05). A batch this size takes Redis
# milliseconds.
RUN_ALL_BATCH = 2_000


async def run_all(redis: Redis, commands: Sequence[tuple[Any, ...]]) -> None:
    """Every command, without MULTI, in round trips of at most RUN_ALL_BATCH commands; the first
    error reply fails the call (others may have run: callers send only what is safe to repeat)."""
    for first in range(0, len(commands), RUN_ALL_BATCH):
        await _run_batch(redis, commands[first : first + RUN_ALL_BATCH])


async def _run_batch(redis: Redis, commands: Sequence[tuple[Any, ...]]) -> None:
    if is_cluster(redis):
        # Outboxes and principals' streams each have a slot of their own: redis-py splits by node.
        async with redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            await pipe.execute()
        return
    for reply in await exchange(redis, commands):
        if isinstance(reply, Exception):
            raise reply
