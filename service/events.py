"""Per-principal event streams: the relay that fills them from the outbox, and the hub that serves
them to Server-Sent-Events connections.

The transition scripts append every committed event to their bucket's outbox stream (the only
place that is atomic with the state change). The relay reads the outboxes with a consumer group,
appends each event to the stream of every principal it concerns, and only then acknowledges it,
so a relay that dies mid-way leaves the event pending for another to reclaim: at-least-once.
Each SSE connection resumes from its Last-Event-ID; one hub per process reads every connected
principal's stream with a single blocking XREAD, so connections cost no Redis connection each.

On a Redis Cluster a multi-key read cannot span slots, and every outbox and every principal's
stream has a slot of its own: the relay runs one blocking XREADGROUP per bucket, and the hub
reads the streams without BLOCK, one XREAD per slot in one pipeline (split by node), pausing
`block_ms` when nothing came.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.asyncio import Redis

from service.backoff import Backoff, stop_tasks
from service.keys import Keys
from service.model import envelope, to_json
from service.outbox import RUN_ALL_BATCH, OutboxConsumer, Read, run_all
from service.redis_client import as_cluster, is_cluster
from service.scripts import pairs_to_fields

log = logging.getLogger(__name__)
GROUP = "events"
CREATED, RESOLVED = "question.created", "question.resolved"
RECLAIM_IDLE_MS = 30_000


def stream_id(raw: str) -> tuple[int, int]:
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    type: str
    data: str  # the envelope as JSON, the same bytes a fetch returns


class EventRelay(OutboxConsumer):
    """Outbox -> per-principal streams. Any number may run at once (one consumer group)."""

    group = GROUP
    label = "event relay"

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        maxlen: int,
        ttl_seconds: int,
        blocking: Redis | None = None,
    ) -> None:
        super().__init__(redis, keys, blocking=blocking)
        self.maxlen = maxlen
        self.ttl_seconds = ttl_seconds

    @property
    def relayed(self) -> int:
        return self.handled

    async def process(self, read: Read) -> None:
        """Every event of the read appended to its recipients' streams, in round trips of
        RUN_ALL_BATCH commands: a read of 500 events for a 10,000-member room is ten million
        commands, too many to hold at once. Every entry is decoded before the first round
        trip, so an entry that cannot be (see OutboxConsumer) fails the read before anything
        was appended, and the one-by-one pass after it appends nothing twice."""
        events = decoded(read)
        rooms: dict[str, list[str]] = {}
        commands: list[tuple[Any, ...]] = []
        trim = ("MAXLEN", "~", self.maxlen)
        for kind, question, data, ref in events:
            for principal in await self._recipients(kind, question, rooms):
                stream = self.keys.events(principal)
                commands.append(("XADD", stream, *trim, "*", "type", kind, "data", data, "outbox", ref))
                commands.append(("EXPIRE", stream, self.ttl_seconds))
            if len(commands) >= RUN_ALL_BATCH:
                await run_all(self.redis, commands)
                commands.clear()
        if commands:
            await run_all(self.redis, commands)

    async def _recipients(
        self, kind: str, question: dict[str, str], rooms: dict[str, list[str]]
    ) -> list[str]:
        """Those a new question waits for; for a resolved one, also its asker."""
        if question["to_kind"] == "user":
            targets = [question["to_id"]]
        else:
            room = question["to_id"]
            if room not in rooms:
                members = await self.redis.smembers(self.keys.room_members(room))
                rooms[room] = sorted(str(m) for m in members)
            targets = rooms[room]
        return targets if kind == CREATED else [question["asker"], *targets]


QUEUE_LIMIT = 1000
_Entry = tuple[str, tuple[int, int], "Event | None"]  # a stream entry's id, its position, its event


@dataclass(eq=False)
class _Subscriber:
    stream: str
    position: str
    # One slot beyond the limit, for the None that ends a reader too slow to keep up.
    queue: asyncio.Queue[Event | None] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT + 1))


class EventHub:
    """One blocking XREAD per process over every connected principal's stream."""

    def __init__(self, redis: Redis, keys: Keys, block_ms: int = 250, blocking: Redis | None = None) -> None:
        self.redis = redis
        self.blocking = blocking or redis
        self.keys = keys
        self.block_ms = block_ms
        self._subscribers: dict[str, set[_Subscriber]] = defaultdict(set)
        self._has_subscribers = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def connections(self) -> int:
        return sum(len(s) for s in self._subscribers.values())

    async def start(self) -> None:
        self._task = asyncio.create_task(self._read_loop(), name="event-hub")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await stop_tasks([self._task])
        self.end_streams()

    def end_streams(self) -> None:
        """Every open stream ends after what it has queued; its client resumes elsewhere with
        Last-Event-ID."""
        for subscribers in self._subscribers.values():
            for subscriber in subscribers:
                if not subscriber.queue.full():  # full: its ending None is queued already
                    subscriber.queue.put_nowait(None)

    def streams_of(self, principal: str) -> int:
        return len(self._subscribers.get(self.keys.events(principal), ()))

    async def latest_id(self, principal: str) -> str:
        newest = await self.redis.xrevrange(self.keys.events(principal), "+", "-", count=1)
        return str(newest[0][0]) if newest else "0-0"

    def subscribe(self, principal: str, after: str) -> _Subscriber:
        """Deliver every event after stream id `after`: the backlog first, then live ones."""
        subscriber = _Subscriber(self.keys.events(principal), after)
        self._subscribers[subscriber.stream].add(subscriber)
        self._has_subscribers.set()
        return subscriber

    def unsubscribe(self, subscriber: _Subscriber) -> None:
        group = self._subscribers.get(subscriber.stream)
        if group is not None:
            group.discard(subscriber)
            if not group:
                del self._subscribers[subscriber.stream]

    async def _read_loop(self) -> None:
        backoff = Backoff("event hub")
        while not self._stopping:
            if not self._subscribers:
                self._has_subscribers.clear()
                await self._has_subscribers.wait()
            positions: dict[Any, Any] = {
                stream: min((s.position for s in group), key=stream_id)
                for stream, group in self._subscribers.items()
            }
            try:
                found: Any = await self._read(positions)
                backoff.succeeded()
                for stream, entries in found or []:
                    self._dispatch(str(stream), entries, read_after=positions[stream])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a RedisError, or an entry the hub cannot read
                await backoff.failed(exc)

    async def _read(self, positions: dict[Any, Any]) -> Any:
        if not is_cluster(self.redis):
            return await self.blocking.xread(positions, count=500, block=self.block_ms)
        cluster = as_cluster(self.redis)
        by_slot: dict[int, dict[Any, Any]] = defaultdict(dict)
        for stream, position in positions.items():
            by_slot[cluster.keyslot(stream)][stream] = position
        async with self.redis.pipeline(transaction=False) as pipe:
            for group in by_slot.values():
                # Naming the node spares redis-py a COMMAND GETKEYS round trip per XREAD.
                pipe.execute_command(
                    "XREAD", "COUNT", 500, "STREAMS", *group, *group.values(),
                    target_nodes=cluster.get_node_from_key(next(iter(group))),
                )  # fmt: skip
            replies = await pipe.execute()
        found = [stream for reply in replies for stream in (reply or [])]
        if not found:
            await asyncio.sleep(self.block_ms / 1000)  # a poll: BLOCK cannot span slots
        return found

    def _dispatch(self, stream: str, entries: Sequence[tuple[str, dict[str, Any]]], read_after: str) -> None:
        """`entries` are those after `read_after`. A subscriber that joined during the read from
        an older position (a second tab, a reconnect while the old connection is held) is left for
        the next read, which starts at its position: given these, it would skip its backlog."""
        start = stream_id(read_after)
        events = [(i, stream_id(i), _event(stream, i, fields)) for i, fields in entries]
        for subscriber in list(self._subscribers.get(stream, ())):
            if stream_id(subscriber.position) < start:
                continue
            self._deliver(subscriber, events)

    def _deliver(self, subscriber: _Subscriber, events: list[_Entry]) -> None:
        after = stream_id(subscriber.position)
        for entry_id, position, event in events:
            if position <= after:
                continue
            if subscriber.queue.qsize() >= QUEUE_LIMIT:
                # Too slow a reader: end its stream; it resumes with Last-Event-ID.
                self.unsubscribe(subscriber)
                subscriber.queue.put_nowait(None)
                return
            if event is not None:
                subscriber.queue.put_nowait(event)
            subscriber.position = entry_id


def decoded(read: Read) -> list[tuple[str, dict[str, str], str, str]]:
    """(kind, question fields, envelope JSON, source ref) of each event of an outbox read."""
    events = []
    for outbox, entries in read:
        for entry_id, fields in entries:
            if not fields:
                continue  # trimmed away before we read it
            kind = CREATED if fields["type"] == CREATED else RESOLVED
            question = pairs_to_fields(msgspec.json.decode(fields["question"]))
            events.append((kind, question, to_json(envelope(question)).decode(), f"{outbox}/{entry_id}"))
    return events


def _event(stream: str, entry_id: str, fields: dict[str, Any]) -> Event | None:
    """The entry as an event; None (logged, and passed over) for one the relay did not write."""
    if "type" not in fields or "data" not in fields:
        log.warning("stream %s entry %s is not an event (%s): skipped", stream, entry_id, sorted(fields))
        return None
    return Event(str(entry_id), str(fields["type"]), str(fields["data"]))
