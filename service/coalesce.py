"""Coalesced script calls: every EVALSHA issued in one event-loop turn goes to Redis as one pipeline.

A request handler awaits its own future; the flush sends the whole batch without MULTI, so one
call's error never touches another's reply. A NOSCRIPT reply (Redis restarted or failed over)
reloads that script and resends just the calls that got it. Pool checkouts, socket writes and
reads are paid once per batch instead of once per call, which is where redis-py spends its time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError


@dataclass(slots=True)
class _Call:
    sha: str
    source: str
    keys: Sequence[str]
    args: Sequence[str | int]
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


# Batches on the wire at once. More would only spread the same calls over more connections;
# while they are out, new calls gather into the next, larger batch.
MAX_IN_FLIGHT = 4


class Coalescer:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._queue: list[_Call] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._scheduled = False
        self.batches = 0
        self.calls = 0
        self.peak_in_flight = 0

    def evalsha(
        self, sha: str, source: str, keys: Sequence[str], args: Sequence[str | int]
    ) -> asyncio.Future[Any]:
        """Queue one script call; the returned future gets its reply or its own exception."""
        call = _Call(sha, source, keys, args)
        self._queue.append(call)
        self._schedule()
        return call.future

    def _schedule(self) -> None:
        if not self._scheduled and len(self._tasks) < MAX_IN_FLIGHT:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._queue or len(self._tasks) >= MAX_IN_FLIGHT:
            return  # a finishing batch schedules the next flush
        batch, self._queue = self._queue, []
        task = asyncio.create_task(self._send(batch))
        self._tasks.add(task)
        self.peak_in_flight = max(self.peak_in_flight, len(self._tasks))
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._queue:
            self._schedule()

    async def _send(self, batch: list[_Call]) -> None:
        self.batches += 1
        self.calls += len(batch)
        try:
            replies = await self._pipeline(batch)
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:
                for source in {batch[i].source for i in missing}:
                    await self.redis.script_load(source)
                resent = await self._pipeline([batch[i] for i in missing])
                for i, reply in zip(missing, resent, strict=True):
                    replies[i] = reply
        except BaseException as exc:
            for call in batch:
                _settle(call.future, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for call, reply in zip(batch, replies, strict=True):
            _settle(call.future, reply)

    async def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.evalsha(call.sha, len(call.keys), *call.keys, *call.args)
            return list(await pipe.execute(raise_on_error=False))

    async def aclose(self) -> None:
        for call in self._queue:
            call.future.cancel()
        self._queue.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return  # the caller gave up (cancelled or timed out); nobody reads this reply
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
