"""Long-poll waiters: one pub/sub connection per process carries every waited-on question channel.

A channel is subscribed once, however many requests wait on it, and unsubscribed when the last
one leaves. A waiter reads the question only after Redis confirmed the subscription, so a
terminal envelope published in between cannot be missed. Every message is a hint; the hash is
the truth: when redis-py reconnects and resubscribes by itself, the unexpected confirmations
make us re-read every waited question, so a publish lost during the outage strands nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.backoff import Backoff, stop_tasks
from service.model import Question
from service.scripts import Fields, pairs_to_fields
from service.store import QuestionStore

log = logging.getLogger(__name__)
RECONNECT_DELAY = 0.2


@dataclass(slots=True)
class _Channel:
    question_id: str
    futures: set[asyncio.Future[Fields]] = field(default_factory=set)
    pending_subscribes: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Waiters:
    def __init__(self, redis: Redis, store: QuestionStore) -> None:
        self._pubsub = redis.pubsub()
        self._store = store
        self._channels: dict[str, _Channel] = {}
        self._connected = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self.resubscriptions = 0
        self._stopping = False
        # redis-py's PubSub.connect() is not safe to race: concurrent first subscribes would each
        # take a pool connection, and messages on all but the last one would never be read.
        self._connect_lock = asyncio.Lock()

    @property
    def waiting(self) -> int:
        return sum(len(c.futures) for c in self._channels.values())

    @property
    def channels(self) -> int:
        return len(self._channels)

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_loop(), name="waiters-reader")

    async def stop(self) -> None:
        self._stopping = True
        await stop_tasks([t for t in (self._reader, *self._background) if t is not None])
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def wait(self, question_id: str, timeout: float) -> Question | None:
        """The question once terminal, or None when `timeout` passes first (or it vanished)."""
        try:
            async with asyncio.timeout(timeout), self._watching([question_id]) as futures:
                question = await self._store.read(question_id)
                if question is None or question.state.terminal:
                    return question
                del question  # parked: hold nothing but the future
                return Question(await futures[question_id])
        except TimeoutError:
            return None

    async def wait_many(self, question_ids: Sequence[str], timeout: float, *, every: bool) -> None:
        """Return when any (every=False) or every (every=True) one of the questions is terminal
        or gone, or when `timeout` passes. The caller reads the outcome: the hash is the truth."""
        try:
            async with asyncio.timeout(timeout), self._watching(question_ids) as futures:
                questions = await self._store.read_many(question_ids)
                open_ids = [
                    q_id
                    for q_id, q in zip(question_ids, questions, strict=True)
                    if q is not None and not q.state.terminal
                ]
                if not open_ids or (not every and len(open_ids) < len(questions)):
                    return
                when = asyncio.ALL_COMPLETED if every else asyncio.FIRST_COMPLETED
                await asyncio.wait([futures[q_id] for q_id in open_ids], return_when=when)
        except TimeoutError:
            return

    @contextlib.asynccontextmanager
    async def _watching(
        self, question_ids: Sequence[str]
    ) -> AsyncIterator[dict[str, asyncio.Future[Fields]]]:
        """Subscribed (confirmed by Redis) to every question's channel for the duration."""
        loop = asyncio.get_running_loop()
        joined: list[tuple[str, _Channel, asyncio.Future[Fields]]] = []
        futures: dict[str, asyncio.Future[Fields]] = {}
        try:
            fresh = []
            for question_id in dict.fromkeys(question_ids):
                channel = self._store.channel(question_id)
                entry = self._channels.get(channel)
                if entry is None:
                    entry = self._channels[channel] = _Channel(question_id)
                future: asyncio.Future[Fields] = loop.create_future()
                if not entry.futures:
                    fresh.append((channel, entry))
                entry.futures.add(future)
                joined.append((channel, entry, future))
                futures[question_id] = future
            if fresh:
                await self._subscribe(fresh)
            for _, entry, _ in joined:
                await entry.ready.wait()
            yield futures
        finally:
            for channel, entry, future in joined:
                self._leave(channel, entry, future)

    async def _subscribe(self, fresh: Sequence[tuple[str, _Channel]]) -> None:
        for _, entry in fresh:
            entry.pending_subscribes += 1
            entry.ready.clear()
        try:
            if self._pubsub.connection is None:
                async with self._connect_lock:
                    await self._pubsub.connect()  # type: ignore[no-untyped-call]
            await self._pubsub.subscribe(*(channel for channel, _ in fresh))
        except BaseException:
            for _, entry in fresh:
                entry.pending_subscribes -= 1
            raise
        self._connected.set()

    def _leave(self, channel: str, entry: _Channel, future: asyncio.Future[Fields]) -> None:
        entry.futures.discard(future)
        if entry.futures:
            return
        if entry.pending_subscribes == 0:
            self._channels.pop(channel, None)
        self._spawn(self._unsubscribe(channel))

    async def _unsubscribe(self, channel: str) -> None:
        entry = self._channels.get(channel)
        if entry is not None and entry.futures:
            return  # someone started waiting again meanwhile
        try:
            await self._pubsub.unsubscribe(channel)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # The connection is gone; redis-py will not resubscribe what it no longer lists.
            log.warning("unsubscribe of %s failed: %s", channel, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _read_loop(self) -> None:
        backoff = Backoff("waiters pub/sub", base=RECONNECT_DELAY, cap=2.0)
        while not self._stopping:
            await self._connected.wait()
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                await backoff.failed(exc)
                continue
            backoff.succeeded()
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind, channel = message["type"], message["channel"]
        entry = self._channels.get(channel)
        if kind == "message":
            if entry is not None:
                self._resolve(entry, pairs_to_fields(json.loads(message["data"])))
        elif kind == "subscribe":
            if entry is None:
                self._spawn(self._unsubscribe(channel))
            elif entry.pending_subscribes > 0:
                entry.pending_subscribes -= 1
                if entry.pending_subscribes == 0:
                    entry.ready.set()
            elif entry.futures:
                # A confirmation nobody asked for: redis-py resubscribed after a reconnect.
                self.resubscriptions += 1
                self._spawn(self._reread(entry))
        if entry is not None and not entry.futures and entry.pending_subscribes == 0:
            self._channels.pop(channel, None)

    async def _reread(self, entry: _Channel) -> None:
        try:
            question = await self._store.read(entry.question_id)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # The waiter's own timeout still bounds it; its final re-read tells the truth.
            log.warning("re-read of %s after resubscribe failed: %s", entry.question_id, exc)
            return
        if question is not None and question.state.terminal:
            self._resolve(entry, question.fields)

    @staticmethod
    def _resolve(entry: _Channel, fields: Fields) -> None:
        for future in entry.futures:
            if not future.done():
                future.set_result(fields)
