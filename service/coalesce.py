"""Coalesced calls: every EVALSHA, and every read on the request path, issued in one event-loop
turn goes to Redis as one pipeline.

A request handler awaits its own future; the flush sends the whole batch without MULTI, so one
call's error never touches another's reply. A NOSCRIPT reply (Redis restarted or failed over)
reloads that script and resends just the calls that got it. Pool checkouts, socket writes and
reads are paid once per batch instead of once per call, which is where redis-py spends its time.
On one Redis node a batch is packed by hiredis and written on the RedisPipe (service/redis_pipe.py),
one connection that carries every batch back to back and hands the replies to hiredis' reader as
they arrive: 24.5 -> 19.4 µs of CPU per fetch read, 64 at once, against `exchange` below (which
had halved it against redis-py's Pipeline). A batch that ends with a WAIT (see Durability) goes
through `exchange` on a pooled connection instead, since WAIT would hold up every batch behind it
on the pipe; the event relay writes through `exchange` too.

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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.redis_client import as_cluster, is_cluster
from service.redis_pipe import RedisPipe

log = logging.getLogger(__name__)
# hiredis' stub types the command as a 1-tuple; it takes any number of arguments.
pack_command: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command


@dataclass(frozen=True, slots=True)
class Durability:
    """QS_WAIT_REPLICAS and QS_WAIT_TIMEOUT_MS: how many replicas must confirm, how long to wait."""

    replicas: int
    timeout_ms: int


@dataclass(slots=True)
class _Call:
    command: tuple[Any, ...]
    source: str | None  # a script's, to reload it on NOSCRIPT; None for a plain read
    key: str  # the first key: which Cluster node a confirmed call's WAIT goes to
    confirm: bool
    future: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


# Batches on the wire at once: while they are out, new calls gather into the next, larger batch,
# and the per-batch costs (a task, a write, a wake-up) are paid by more calls.
MAX_IN_FLIGHT = 4


class Coalescer:
    def __init__(self, redis: Redis, *, durability: Durability | None = None) -> None:
        self.redis = redis
        self.cluster = is_cluster(redis)
        self.pipe = RedisPipe(redis) if not self.cluster and RedisPipe.supports(redis) else None
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
        return self._queue_call(
            _Call(("EVALSHA", sha, len(keys), *keys, *args), source, keys[0] if keys else "", confirm)
        )

    def read(self, command: str, key: str, *args: str | int) -> asyncio.Future[Any]:
        """Queue one read-only, non-blocking command on one key (SISMEMBER, HGET, ...) into the same
        batches. Moving a room fetch's one membership read here from a pooled connection took its
        CPU from 161 to 90 µs (docs/benchmarks.md), and under a burst such reads had queued for the
        pool (docs/operations.md, "Known limits"). A dropped connection re-sends them like scripts.
        The reply is not put through redis-py's response callbacks on one node (SISMEMBER gives
        0 or 1, not a bool), so callers convert it."""
        return self._queue_call(_Call((command, key, *args), None, key, False))

    def _queue_call(self, call: _Call) -> asyncio.Future[Any]:
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
                    if source is not None:  # a plain read never gets NOSCRIPT
                        await self.redis.script_load(source)
                resent = await self._pipeline([batch[i] for i in missing])
                for i, reply in zip(missing, resent, strict=True):
                    replies[i] = reply
            for call, reply in zip(batch, replies, strict=True):
                _settle(call.future, reply)
        except BaseException as exc:  # every caller hears of it; those settled already keep theirs
            for call in batch:
                _settle(call.future, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        if not self.cluster:
            return await self._exchange(calls)
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                # execute_command: redis-py's ClusterPipeline blocks its evalsha() helper, though
                # it routes EVALSHA by its keys (one slot per call here) like any other command.
                pipe.execute_command(*call.command)
            waits = self._queue_waits(pipe, calls)
            replies = list(await pipe.execute(raise_on_error=False))
        if waits:
            self._check_waits(replies[len(calls) :], waits)
        return replies[: len(calls)]

    async def _exchange(self, calls: Sequence[_Call]) -> list[Any]:
        """One node: the batch on the pipe; through `exchange` when it ends with a WAIT (or the
        client's connections cannot be piped, as fakeredis' cannot)."""
        commands: list[tuple[Any, ...]] = [c.command for c in calls]
        wait = self._wait_args(calls)
        if wait is None and self.pipe is not None:
            return await self.pipe.exchange([pack_command(command) for command in commands])
        if wait is not None:
            commands.append(wait)
        # WAIT blocks up to its own timeout, on top of the batch's socket timeout.
        replies = await exchange(self.redis, commands, extra_seconds=wait[2] / 1000 if wait else 0.0)
        if wait is not None:
            self._check_waits(replies[len(calls) :], ["redis"])
        return replies[: len(calls)]

    def _wait_args(self, calls: Sequence[_Call]) -> tuple[str, int, int] | None:
        """The Durability's WAIT, when the batch holds a call that asks for it."""
        durability = self.durability
        if durability is None or not durability.replicas or not any(c.confirm for c in calls):
            return None
        return ("WAIT", durability.replicas, durability.timeout_ms)

    def _queue_waits(self, pipe: Any, calls: Sequence[_Call]) -> list[str]:
        """Cluster: one WAIT per node that got a confirmed call; the node names, in order."""
        wait = self._wait_args(calls)
        if wait is None:
            return []
        cluster = as_cluster(self.redis)
        owners = (cluster.get_node_from_key(call.key) for call in calls if call.confirm)
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
        if self.pipe is not None:  # last: a batch failed by the close would be retried
            await self.pipe.aclose()


async def exchange(
    redis: Redis, commands: Sequence[tuple[Any, ...]], *, extra_seconds: float = 0.0
) -> list[Any]:
    """One Redis node, no MULTI: the commands written at once on one pooled connection and their
    replies read under one timeout; each error reply comes back in its place as its exception.
    redis-py's Pipeline costs about twice as much per command (a command stack, arguments
    encoded in Python, a timeout context per reply); hiredis' C packer packs these. A connection
    error or timeout drops the connection and re-sends everything through the client's Retry, as
    the Pipeline did: callers send only commands that are safe to repeat."""
    packed = [pack_command(command) for command in commands]
    pool: Any = redis.connection_pool  # redis-py types get_connection loosely
    connection = await pool.get_connection()
    try:
        budget = connection.socket_timeout
        if budget is not None:
            budget += extra_seconds
        replies: list[Any] = await connection.retry.call_with_retry(
            lambda: _send_and_read(connection, packed, budget),
            lambda _error: connection.disconnect(),
        )
    finally:
        await pool.release(connection)
    return replies


async def _send_and_read(connection: Any, packed: list[bytes], budget: float | None) -> list[Any]:
    await connection.send_packed_command(packed, check_health=False)
    replies: list[Any] = []
    try:
        async with asyncio.timeout(budget):
            for _ in packed:
                try:
                    replies.append(await connection.read_response(timeout=math.inf))
                except ResponseError as exc:
                    replies.append(exc)  # this call's own error; the batch goes on
    except TimeoutError:
        # The read was cancelled mid-batch: redis-py dropped the connection (unread replies);
        # redis-py's own timeout error is the one its Retry and the service's 503 know.
        raise RedisTimeoutError(f"no reply to a batch of {len(packed)} within {budget} s") from None
    return replies


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if future.done():
        return  # the caller gave up (cancelled or timed out); nobody reads this reply
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
