"""Coalesced script calls: every EVALSHA issued in one event-loop turn goes to Redis as one pipeline.

A request handler awaits its own future; the flush sends the whole batch without MULTI, so one
call's error never touches another's reply. A NOSCRIPT reply (Redis restarted or failed over)
reloads that script and resends just the calls that got it. Pool checkouts, socket writes and
reads are paid once per batch instead of once per call, which is where redis-py spends its time.

On a Redis Cluster the batch is a ClusterPipeline: redis-py splits it by node, sends each part on
one connection, follows MOVED/ASK per call, and retries the whole batch on a new topology after a
connection error (every script is re-run safe: call ids). SCRIPT LOAD goes to every primary, so
a replica promoted by a failover gets the scripts on its first NOSCRIPT.

With a Durability, each batch that holds a confirmed call (answer, cancel) ends with
`WAIT replicas timeout` on every node those calls went to, on the same connection as their
EVALSHAs (WAIT only covers the writes of its own connection).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from service.redis_client import as_cluster, is_cluster

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Durability:
    """QS_WAIT_REPLICAS and QS_WAIT_TIMEOUT_MS: how many replicas must confirm, how long to wait."""

    replicas: int
    timeout_ms: int


@dataclass(slots=True)
class _Call:
    sha: str
    source: str
    keys: Sequence[str]
    args: Sequence[str | int]
    confirm: bool
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


# Batches on the wire at once. More would only spread the same calls over more connections;
# while they are out, new calls gather into the next, larger batch.
MAX_IN_FLIGHT = 4


class Coalescer:
    def __init__(self, redis: Redis, *, durability: Durability | None = None) -> None:
        self.redis = redis
        self.cluster = is_cluster(redis)
        self.durability = durability
        self.replication_unconfirmed = 0
        self._queue: list[_Call] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._scheduled = False
        self.batches = 0
        self.calls = 0
        self.peak_in_flight = 0

    def evalsha(
        self, sha: str, source: str, keys: Sequence[str], args: Sequence[str | int], *, confirm: bool = False
    ) -> asyncio.Future[Any]:
        """Queue one script call; the returned future gets its reply or its own exception.
        `confirm`: follow it with the Durability's WAIT (when there is one)."""
        call = _Call(sha, source, keys, args, confirm)
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
                # execute_command: redis-py's ClusterPipeline blocks its evalsha() helper, though
                # it routes EVALSHA by its keys (one slot per call here) like any other command.
                pipe.execute_command("EVALSHA", call.sha, len(call.keys), *call.keys, *call.args)
            waits = self._queue_waits(pipe, calls)
            replies = list(await pipe.execute(raise_on_error=False))
        if waits:
            self._check_waits(replies[len(calls) :], waits)
        return replies[: len(calls)]

    def _queue_waits(self, pipe: Any, calls: Sequence[_Call]) -> list[str]:
        """Append one WAIT per node that got a confirmed call; the node names, in order."""
        durability = self.durability
        confirmed = [call for call in calls if call.confirm]
        if durability is None or not durability.replicas or not confirmed:
            return []
        wait = ("WAIT", durability.replicas, durability.timeout_ms)
        if not self.cluster:
            pipe.execute_command(*wait)
            return ["redis"]
        cluster = as_cluster(self.redis)
        owners = (cluster.get_node_from_key(call.keys[0]) for call in confirmed)
        nodes = {node.name: node for node in owners if node is not None}  # None: slot uncovered
        for node in nodes.values():
            pipe.execute_command(*wait, target_nodes=node)
        return list(nodes)

    def _check_waits(self, replies: Sequence[Any], nodes: Sequence[str]) -> None:
        """An unconfirmed replication is reported, never an error: the write is on the primary."""
        assert self.durability is not None
        for node, acked in zip(nodes, replies, strict=True):
            if isinstance(acked, int) and acked >= self.durability.replicas:
                continue
            self.replication_unconfirmed += 1
            log.warning(
                "replication unconfirmed on %s: %s of %d replicas within %d ms (QS_WAIT_REPLICAS)",
                node,
                acked,
                self.durability.replicas,
                self.durability.timeout_ms,
            )

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
