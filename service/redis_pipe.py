"""One pipelined Redis connection for the coalescer's batches on one Redis node.

redis-py reads a batch's replies one `read_response` coroutine at a time, on a connection
checked out of its pool per batch: a fetch's whole store read cost 24.5 µs of CPU that way and
19.4 µs through this pipe (64 at once; docs/benchmarks.md, "Findings of 2026-12-04, third
session"). Here every batch is written on one connection as soon as it is formed, without
waiting for the batches before it (Redis answers in order), and `data_received` hands the bytes
to hiredis' C reader and settles a whole batch's future once its last reply is in.

redis-py still does everything but the steady state: it opens the connection (TCP, TLS or a
Unix socket, AUTH, SELECT, the client name, keepalive) and its Retry decides how often and how
soon a batch is re-sent after the connection drops or a batch outlives the socket timeout. The
connection is then taken over from redis-py's stream reader (`Transport.set_protocol`), so
redis-py no longer reads it.

A failure drops the connection and fails every batch on it, each of which its own Retry re-sends
on a new connection: callers send only calls that are safe to repeat (every script carries a
call id). Each error reply comes back in its place as redis-py's exception for it (NOSCRIPT as
NoScriptError), never failing its neighbours.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

# redis-py's own connection classes, whose transport is a real asyncio transport; subclasses
# (fakeredis' among them) may not be, and stay on the pooled path.
PIPEABLE = (Connection, SSLConnection, UnixDomainSocketConnection)


class _Batch:
    __slots__ = ("expected", "future", "replies", "timer")

    def __init__(self, expected: int, future: asyncio.Future[list[Any]]) -> None:
        self.expected = expected
        self.future = future
        self.replies: list[Any] = []
        self.timer: asyncio.TimerHandle | None = None


class _PipeProtocol(asyncio.Protocol):
    """The connection once redis-py has opened it: batches out, replies back in order."""

    def __init__(self, transport: Any, reader: hiredis.Reader) -> None:
        self.transport = transport
        # redis-py's own protocol still learns of the close, so its StreamWriter.wait_closed()
        # returns when redis-py disconnects the connection (the client's aclose() does).
        self.stream_protocol: asyncio.BaseProtocol = transport.get_protocol()
        self.reader = reader
        self.in_flight: deque[_Batch] = deque()
        self.open = True

    @property
    def usable(self) -> bool:
        """Not dropped, and not closed by the peer in a way not yet reported."""
        return self.open and not self.transport.is_closing()

    def send(self, packed: Sequence[bytes], budget: float | None) -> asyncio.Future[list[Any]]:
        loop = asyncio.get_running_loop()
        batch = _Batch(len(packed), loop.create_future())
        self.transport.writelines(packed)
        self.in_flight.append(batch)
        if budget is not None:
            batch.timer = loop.call_later(budget, self._outlived, batch)
        return batch.future

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        in_flight = self.in_flight
        try:
            while (reply := self.reader.gets()) is not False:
                batch = in_flight[0]
                batch.replies.append(reply)
                if len(batch.replies) == batch.expected:
                    in_flight.popleft()
                    _settle(batch)
        except (InvalidResponse, IndexError) as exc:  # garbage, or a reply nobody asked for
            self.drop(RedisConnectionError(f"Redis sent an unreadable reply: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.drop(RedisConnectionError(f"Redis closed the connection: {exc or 'EOF'}"))
        self.stream_protocol.connection_lost(exc)

    def _outlived(self, batch: _Batch) -> None:
        # Unread replies would be read as the next batch's: the connection cannot be reused.
        self.drop(RedisTimeoutError(f"no reply to a batch of {batch.expected} in time"))

    def drop(self, error: Exception) -> None:
        if self.open:
            self.open = False
            self.transport.abort()
        while self.in_flight:
            batch = self.in_flight.popleft()
            if batch.timer is not None:
                batch.timer.cancel()
            if not batch.future.done():
                batch.future.set_exception(error)


def _settle(batch: _Batch) -> None:
    if batch.timer is not None:
        batch.timer.cancel()
    if not batch.future.done():  # done: its caller was cancelled; its replies are read all the same
        batch.future.set_result(batch.replies)


class RedisPipe:
    """Batches of packed commands on one connection, each batch's replies in order.

    The connection is checked out of the client's pool for good, so it counts against the
    pool's cap and the client's aclose() closes it like any other."""

    def __init__(self, redis: Redis) -> None:
        pool: Any = redis.connection_pool  # redis-py types its pool's methods loosely
        self.pool = pool
        self._connection: Any = None  # the pooled AbstractConnection, once checked out
        self._protocol: _PipeProtocol | None = None
        self._retry: Retry = pool.make_connection().retry  # a pooled connection's policy
        self._budget: float | None = pool.connection_kwargs.get("socket_timeout")
        self._connecting = asyncio.Lock()
        self.connections = 0  # opened so far (the tests read it)

    @staticmethod
    def supports(redis: Redis) -> bool:
        return redis.connection_pool.connection_class in PIPEABLE

    async def exchange(self, packed: Sequence[bytes]) -> list[Any]:
        """The replies to `packed`, in order; an error reply is its exception, in its place.
        Never a blocking command (BLPOP, WAIT, ...): it would hold up every batch behind it."""
        return await self._retry.call_with_retry(lambda: self._send(packed), _ignore)

    async def _send(self, packed: Sequence[bytes]) -> list[Any]:
        protocol = self._protocol
        if protocol is None or not protocol.usable:
            protocol = await self._connect()
        return await protocol.send(packed, self._budget)

    async def _connect(self) -> _PipeProtocol:
        async with self._connecting:
            if self._protocol is not None and self._protocol.usable:
                return self._protocol  # another caller connected while this one waited
            if self._connection is None:
                self._connection = await self.pool.get_connection()
            else:  # the dropped transport is closed already: nothing to wait for
                await self._connection.disconnect(nowait=True)
                await self._connection.connect()
            self._protocol = _take_over(self._connection)
            self.connections += 1
            return self._protocol

    async def aclose(self) -> None:
        connection, self._connection, self._protocol = self._connection, None, None
        if connection is not None:
            await connection.disconnect()
            await self.pool.release(connection)


def _take_over(connection: AbstractConnection) -> _PipeProtocol:
    """The connection's transport, from now on read by a _PipeProtocol instead of redis-py."""
    writer: asyncio.StreamWriter | None = getattr(connection, "_writer", None)
    if writer is None:
        raise RedisConnectionError("redis-py opened no stream for the pipe")
    encoder = connection.encoder
    text = (
        {"encoding": encoder.encoding, "errors": encoder.encoding_errors} if encoder.decode_responses else {}
    )
    reader = hiredis.Reader(
        protocolError=InvalidResponse,
        replyError=BaseParser.parse_error,  # redis-py's exception per error (NOSCRIPT: NoScriptError)
        **text,
    )
    protocol = _PipeProtocol(writer.transport, reader)
    writer.transport.set_protocol(protocol)
    return protocol


async def _ignore(_error: Exception) -> None:
    """The Retry's failure hook: the protocol has already dropped the connection."""
