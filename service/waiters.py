"""Long-poll waiters: one pub/sub connection per process carries every waited-on question channel.

A channel is subscribed once, however many requests wait on it, and unsubscribed when the last
one leaves. A waiter reads the question only after Redis confirmed the subscription, so a
terminal envelope published in between cannot be missed. Every message is a hint; the hash is
the truth: when redis-py reconnects and resubscribes by itself, the unexpected confirmations
make us re-read every waited question, so a publish lost during the outage strands nobody.

On a Redis Cluster the channels are sharded (SSUBSCRIBE; the scripts SPUBLISH): redis-py's
ClusterPubSub keeps one connection per primary that owns a waited-on channel, and after a
failover or slot migration it moves each channel to its new owner. Both the resubscription after
a reconnect and that move confirm a subscription nobody asked for, which triggers the same
re-read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.backoff import Backoff, stop_tasks
from service.model import Question, State
from service.redis_client import as_cluster, retry_failover
from service.scripts import Fields, pairs_to_fields
from service.store import QuestionStore

if TYPE_CHECKING:
    from service.metrics import Metrics

log = logging.getLogger(__name__)
RECONNECT_DELAY = 0.2
# On a cluster, messages are read from each primary's connection in turn, waiting this long on
# each: the most a message waits behind the others' reads.
SHARDED_POLL_SECONDS = 0.02
# Sharded pub/sub kinds, named like the plain ones for _dispatch.
_PLAIN_KIND = {"smessage": "message", "ssubscribe": "subscribe", "sunsubscribe": "unsubscribe"}


_Joined = list[tuple[str, "_Channel", "asyncio.Future[Fields]"]]
# What a parked waiter's own future is set to when its deadline passes first.
_TIMED_OUT: Fields = {}


async def _parked(
    futures: Sequence[asyncio.Future[Fields]], deadline: float, when: str
) -> set[asyncio.Future[Fields]]:
    """The futures done by `deadline` (loop time), waiting as `when` says. The deadline is the
    only bound here: parking runs after the asyncio.timeout that bounded the subscribe and read,
    so a parked request holds no Timeout (and on Python 3.11 an asyncio.wait_for inside redis-py,
    a SUBSCRIBE's send, could swallow that timeout's one cancel anyway)."""
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        return {f for f in futures if f.done()}
    done, _ = await asyncio.wait(futures, timeout=remaining, return_when=when)
    return done


async def _parked_alone(
    future: asyncio.Future[Fields], deadline: float, loop: asyncio.AbstractEventLoop
) -> Fields | None:
    """The common case: the terminal fields, or None when `deadline` passes first. The waiter's
    future is its own, so the deadline's timer settles it directly: one timer and no helper
    future, callback or set per parked request (tracemalloc counts each)."""
    if not future.done():
        timer = loop.call_at(deadline, _set_if_pending, future, _TIMED_OUT)
        try:
            await future
        finally:
            timer.cancel()
    fields = future.result()
    return None if fields is _TIMED_OUT else fields


def _set_if_pending(future: asyncio.Future[Any], result: Any = None) -> None:
    if not future.done():
        future.set_result(result)


def _connect_one_at_a_time(connection: Any) -> None:
    """redis-py's PubSub reconnects from whichever task's command failed (the reader's read, a
    SUBSCRIBE, an UNSUBSCRIBE), and a connection's connect takes no lock: racing connects each
    opened a socket, the later overwrote the earlier, which stayed open and subscribed until the
    garbage collector closed it (a chaos run's ResourceWarning, 2026-12-04). A second connect
    now waits for the first and finds the connection open."""
    lock = asyncio.Lock()
    connect = connection.connect_check_health

    async def one_at_a_time(*args: Any, **kwargs: Any) -> None:
        if connection.is_connected:  # as redis-py's own first check; its resubscribe nests here
            return
        async with lock:
            await connect(*args, **kwargs)

    connection.connect_check_health = one_at_a_time


def _raise_if_a_cancel_was_absorbed() -> None:
    """On Python 3.11, asyncio.wait_for (around redis-py's socket write) drops a cancel that
    arrives as the write completes: a request whose client hung up then held its wait to the
    timeout. The task still counts the cancel as requested, so it is raised here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass(slots=True)
class _Channel:
    question_id: str
    futures: set[asyncio.Future[Fields]] = field(default_factory=set)
    pending_subscribes: int = 0
    # Pending while a SUBSCRIBE awaits Redis's confirmation, None once confirmed: a future made
    # per subscribe, not an asyncio.Event per channel (whose deque alone is ~0.75 KiB).
    ready: asyncio.Future[None] | None = None

    def confirmed(self) -> None:
        if self.ready is not None:
            _set_if_pending(self.ready)
            self.ready = None


class Waiters:
    def __init__(self, redis: Redis, store: QuestionStore) -> None:
        self._pubsub = redis.pubsub()
        # On a cluster client, pubsub() is a ClusterPubSub: the waiters use its sharded side.
        self._sharded = self._pubsub if isinstance(self._pubsub, ClusterPubSub) else None
        self._cluster = as_cluster(redis) if self._sharded is not None else None
        self._poll_index = 0
        self._store = store
        self._channels: dict[str, _Channel] = {}
        self._connected = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self.resubscriptions = 0
        self.reconnects = 0  # of the plain pub/sub connection (a connect callback counts them)
        self.metrics: Metrics | None = None  # set by the app: wake latency
        self._stopping = False
        self._released = False  # release_all: the process is shutting down
        # redis-py's PubSub.connect() is not safe to race: concurrent first subscribes would each
        # take a pool connection, and messages on all but the last one would never be read.
        self._connect_lock = asyncio.Lock()

    @property
    def waiting(self) -> int:
        return sum(len(c.futures) for c in self._channels.values())

    @property
    def channels(self) -> int:
        return len(self._channels)

    @property
    def confirming(self) -> int:
        """Channels whose SUBSCRIBE Redis has not confirmed yet."""
        return sum(1 for c in self._channels.values() if c.ready is not None)

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_loop(), name="waiters-reader")

    def release_all(self) -> None:
        """Shutting down: every parked request returns now, as if its timeout had passed (the
        caller reads the question as it stands). Waits started after this return at once."""
        self._released = True
        for entry in self._channels.values():
            for future in entry.futures:
                _set_if_pending(future, _TIMED_OUT)

    async def stop(self) -> None:
        self._stopping = True
        await stop_tasks([t for t in (self._reader, *self._background) if t is not None])
        await self._pubsub.aclose()

    async def wait(self, question_id: str, timeout: float) -> Question | None:
        """The question once terminal, or None when `timeout` passes first (or it vanished)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        joined, fresh = self._join([question_id])
        try:
            async with asyncio.timeout_at(deadline):
                await self._confirmed(joined, fresh)
                question = await self._store.read(question_id)
            if question is None or question.state.terminal:
                return question
            del question  # parked: hold nothing but the future
            if self._released:
                return None
            fields = await _parked_alone(joined[0][2], deadline, loop)
            if fields is None:
                return None
            if self.metrics is not None:
                self.metrics.woke(fields.get("resolved_ms"))
            return Question(fields)
        except TimeoutError:
            return None
        finally:
            self._leave_all(joined)

    async def wait_many(self, question_ids: Sequence[str], timeout: float, *, every: bool) -> None:
        """Return when any (every=False) or every (every=True) one of the questions is terminal
        or gone, or when `timeout` passes. The caller reads the outcome: the hash is the truth."""
        deadline = asyncio.get_running_loop().time() + timeout
        joined, fresh = self._join(question_ids)
        futures = {entry.question_id: future for _, entry, future in joined}
        try:
            async with asyncio.timeout_at(deadline):
                await self._confirmed(joined, fresh)
                questions = await self._store.read_many(question_ids)
            open_ids = [
                q_id
                for q_id, q in zip(question_ids, questions, strict=True)
                if q is not None and not q.state.terminal
            ]
            if not open_ids or (not every and len(open_ids) < len(questions)):
                return
            when = asyncio.ALL_COMPLETED if every else asyncio.FIRST_COMPLETED
            if self._released:
                return
            done = await _parked([futures[q_id] for q_id in open_ids], deadline, when)
            if self._released or not done or (every and len(done) < len(open_ids)):
                return  # the timeout passed first, or the process is shutting down
            if self.metrics is not None:
                # The condition was met by the latest of these to resolve.
                resolved = [f.result().get("resolved_ms") or "0" for f in done]
                self.metrics.woke(max(resolved, key=int, default=None))
        except TimeoutError:
            return
        finally:
            self._leave_all(joined)

    def _join(self, question_ids: Sequence[str]) -> tuple[_Joined, list[tuple[str, _Channel]]]:
        """A future of this request's own on every question's channel, and the channels nobody
        waited on until now (to subscribe)."""
        loop = asyncio.get_running_loop()
        joined: _Joined = []
        fresh: list[tuple[str, _Channel]] = []
        for question_id in dict.fromkeys(question_ids):
            channel = self._store.channel(question_id)
            entry = self._channels.get(channel)
            if entry is None:
                entry = self._channels[channel] = _Channel(question_id)
            if not entry.futures:
                fresh.append((channel, entry))
            future: asyncio.Future[Fields] = loop.create_future()
            entry.futures.add(future)
            joined.append((channel, entry, future))
        return joined, fresh

    async def _confirmed(self, joined: _Joined, fresh: Sequence[tuple[str, _Channel]]) -> None:
        """Subscribed (confirmed by Redis) to every joined channel: only then is a read safe."""
        if fresh:
            await self._subscribe(fresh)
        for _, entry, _ in joined:
            if entry.ready is not None:
                # Shielded: the future is shared by every request joining during the subscribe.
                await asyncio.shield(entry.ready)

    def _leave_all(self, joined: _Joined) -> None:
        for channel, entry, future in joined:
            self._leave(channel, entry, future)

    async def _subscribe(self, fresh: Sequence[tuple[str, _Channel]]) -> None:
        loop = asyncio.get_running_loop()
        for _, entry in fresh:
            entry.pending_subscribes += 1
            if entry.ready is None:
                entry.ready = loop.create_future()
        if self._sharded is not None:
            self._spawn(self._ssubscribe(fresh))
            self._connected.set()
            return
        try:
            if self._pubsub.connection is None:
                await self._connect()
            await self._pubsub.subscribe(*(channel for channel, _ in fresh))
            _raise_if_a_cancel_was_absorbed()
        except BaseException as exc:
            self._subscribe_failed(fresh)
            if isinstance(exc, AttributeError | RuntimeError):
                # redis-py's reconnect racing the reader's (see _unsubscribe): the connection
                # died under the SUBSCRIBE. An outage (503) for this caller, not a 500.
                raise RedisConnectionError(f"pub/sub connection lost while subscribing: {exc!r}") from exc
            raise
        self._connected.set()

    async def _connect(self) -> None:
        async with self._connect_lock:
            if self._pubsub.connection is None:  # not connected by the request before us
                await self._pubsub.connect()  # type: ignore[no-untyped-call]
                self._adopt_connection()

    def _subscribe_failed(self, fresh: Sequence[tuple[str, _Channel]]) -> None:
        """A SUBSCRIBE that did not go through (its request went away, or the connection died).
        Requests that joined its channels meanwhile await its confirmation: release them, and
        subscribe again for them. That confirmation is one nobody asked for, so it re-reads:
        a publish before it is not lost."""
        for channel, entry in fresh:
            entry.pending_subscribes -= 1
            if entry.pending_subscribes == 0 and entry.ready is not None:
                entry.confirmed()
                self._spawn(self._resubscribe(channel))

    async def _ssubscribe(self, fresh: Sequence[tuple[str, _Channel]]) -> None:
        """Cluster: one SSUBSCRIBE per channel, each on the connection to its slot's primary; a
        primary demoted by a failover drops those connections, so it is retried on the new one.
        It runs apart from the waiting requests, which await the confirmation (entry.ready):
        redis-py's cluster pub/sub can hold a cancelled caller inside a dead connection's
        reconnect. When it fails for good, the waiters read anyway and end at their timeout
        with a final re-read: slower, never wrong."""
        assert self._sharded is not None
        assert self._cluster is not None
        sharded, channels = self._sharded, [channel for channel, _ in fresh]
        try:
            await retry_failover(self._cluster, lambda: sharded.ssubscribe(*channels))
        except (RedisError, AttributeError) as exc:
            log.warning("SSUBSCRIBE of %d channels failed: %r", len(channels), exc)
            for _, entry in fresh:
                entry.pending_subscribes -= 1
                if entry.pending_subscribes == 0:
                    entry.confirmed()

    def _adopt_connection(self) -> None:
        """redis-py reconnects the pub/sub connection by itself (and resubscribes); its connect
        callbacks run on every later connect of the same connection, and those connects are
        made one at a time."""
        connection = self._pubsub.connection
        if connection is not None:
            connection.register_connect_callback(self._reconnected)
            _connect_one_at_a_time(connection)

    def _reconnected(self, _connection: Any) -> None:
        self.reconnects += 1

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
            if self._sharded is not None:
                await self._sharded.sunsubscribe(channel)
            else:
                await self._pubsub.unsubscribe(channel)
        except (RedisConnectionError, RedisTimeoutError, AttributeError, RuntimeError) as exc:
            # The connection died under the command. AttributeError (a writer just dropped) and
            # RuntimeError (two reads on one socket) are redis-py's own reconnect racing the
            # reader's. The same resubscribe-then-unsubscribe path heals it.
            log.warning("unsubscribe of %s failed: %r", channel, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _read_loop(self) -> None:
        backoff = Backoff("waiters pub/sub", base=RECONNECT_DELAY, cap=2.0)
        while not self._stopping:
            await self._connected.wait()
            try:
                message = await self._next_message()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                await backoff.failed(exc)
                continue
            except Exception as exc:
                # redis-py's reconnect racing this read: "read() called while another coroutine
                # is already waiting", or a reply to its handshake read here. This reader is
                # every waiter's only way to wake, so it must not end: start the connection over.
                log.warning("waiters pub/sub read failed, reconnecting: %r", exc)
                await self._start_over()
                await backoff.failed(exc)
                continue
            backoff.succeeded()
            if message is not None:
                self._dispatch_one(message)

    async def _start_over(self) -> None:
        """Drop the pub/sub connections, whose state is unknown. The next read reconnects, and
        redis-py resubscribes every channel: each confirmation re-reads its question."""
        pubsubs = (
            [self._pubsub] if self._sharded is None else list(self._sharded.node_pubsub_mapping.values())
        )
        for pubsub in pubsubs:
            if pubsub.connection is not None:
                await pubsub.connection.disconnect()

    def _dispatch_one(self, message: dict[str, Any]) -> None:
        """Anything may PUBLISH on a question channel (an operator's redis-cli, an older
        release's script): a message this reader cannot read must not end it for every waiter."""
        try:
            self._dispatch(message)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # DecodeError: a ValueError
            log.warning("pub/sub message on %r skipped: %r", message.get("channel"), exc)

    async def _next_message(self) -> dict[str, Any] | None:
        if self._sharded is None:
            message: dict[str, Any] | None = await self._pubsub.get_message(timeout=1.0)
            return message
        # Each primary's connection in turn, picked here: redis-py's own round robin ends for
        # good once it meets an empty mapping (a generator that returns).
        names = list(self._sharded.node_pubsub_mapping)
        node = None
        if names and self._cluster is not None:
            self._poll_index = (self._poll_index + 1) % len(names)
            node = self._cluster.get_node(node_name=names[self._poll_index])
        if node is None:
            # No primary holds a waited-on channel right now (none waited, or a move is under
            # way): nothing to read.
            await asyncio.sleep(SHARDED_POLL_SECONDS)
            return None
        try:
            found: dict[str, Any] | None = await self._sharded.get_sharded_message(
                timeout=SHARDED_POLL_SECONDS, target_node=node
            )
        except (AttributeError, RuntimeError) as exc:  # redis-py racing a reconnect or a move
            raise RedisConnectionError(f"sharded pub/sub read failed: {exc!r}") from exc
        return found

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind, channel = message["type"], message["channel"]
        kind = _PLAIN_KIND.get(kind, kind)
        entry = self._channels.get(channel)
        if kind == "message":
            if entry is not None:
                self._published(entry, message["data"])
        elif kind == "subscribe":
            if entry is None:
                self._spawn(self._unsubscribe(channel))
            elif entry.pending_subscribes > 0:
                entry.pending_subscribes -= 1
                if entry.pending_subscribes == 0:
                    entry.confirmed()
            elif entry.futures:
                # A confirmation nobody asked for: redis-py resubscribed after a reconnect, or
                # _resubscribe below. A publish may have come and gone meanwhile: read again.
                self.resubscriptions += 1
                self._spawn(self._reread(entry))
        elif kind == "unsubscribe" and entry is not None and entry.futures and not entry.pending_subscribes:
            # Unsubscribed under a parked waiter: an earlier waiter's unsubscribe, retried by
            # redis-py across a reconnect, overtook this one's subscribe, or (cluster) the slot's
            # primary changed. Subscribe again; the confirmation re-reads.
            self._spawn(self._resubscribe(channel))
        if entry is not None and not entry.futures and entry.pending_subscribes == 0:
            self._channels.pop(channel, None)

    def _published(self, entry: _Channel, data: Any) -> None:
        """Only the transition scripts publish on a question's channel, always its final fields.
        Anything else (a hand-typed PUBLISH, another program sharing the Redis) wakes nobody
        with it: the hash is the truth, so it is read again."""
        try:
            fields = pairs_to_fields(msgspec.json.decode(data))
            final = fields["id"] == entry.question_id and State.of(fields["state"]).terminal
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            final = False
        if final:
            self._resolve(entry, fields)
            return
        log.warning(
            "%s carried a message that is not its question's final state: reading it", entry.question_id
        )
        self._spawn(self._reread(entry))

    async def _resubscribe(self, channel: str) -> None:
        entry = self._channels.get(channel)
        if entry is None or not entry.futures:
            return  # nobody waits on it any more
        try:
            if self._sharded is not None and self._cluster is not None:
                sharded = self._sharded
                await retry_failover(self._cluster, lambda: sharded.ssubscribe(channel))
            else:
                await self._pubsub.subscribe(channel)
        except (RedisError, AttributeError, RuntimeError) as exc:
            # As in _ssubscribe: the waiter's own timeout and final read still bound it.
            log.warning("resubscribe of %s failed: %r", channel, exc)

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
