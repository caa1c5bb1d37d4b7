"""The coalescer's one pipelined connection on one Redis node (service/redis_pipe.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import hiredis
import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.coalesce import Coalescer
from service.redis_pipe import RedisPipe
from tests.redis_server import RedisServer

pack: Any = hiredis.pack_command


def packed(*commands: tuple[Any, ...]) -> list[bytes]:
    return [pack(command) for command in commands]


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A client of its own with a short socket timeout and no retries, so failures show."""
    client = Redis.from_url(
        redis_server.url, decode_responses=True, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    yield client
    await client.aclose()


async def test_batches_sent_at_once_share_one_connection_and_each_gets_its_own_replies(
    client: Redis,
) -> None:
    pipe = RedisPipe(client)
    batches = [packed(("CLIENT", "ID"), ("ECHO", f"batch {i}")) for i in range(20)]
    replies = await asyncio.gather(*(pipe.exchange(batch) for batch in batches))
    assert [echo for _, echo in replies] == [f"batch {i}" for i in range(20)]
    assert len({client_id for client_id, _ in replies}) == 1
    assert pipe.connections == 1


async def test_an_error_reply_stays_in_its_place_as_redis_pys_exception(client: Redis) -> None:
    pipe = RedisPipe(client)
    replies = await pipe.exchange(
        packed(("SET", "pipe:k", "v"), ("INCR", "pipe:k"), ("EVALSHA", "0" * 40, 0), ("GET", "pipe:k"))
    )
    assert replies[0] == "OK"
    assert type(replies[1]) is ResponseError
    assert isinstance(replies[2], NoScriptError)
    assert replies[3] == "v"


async def test_a_killed_connection_is_replaced_and_the_batch_is_resent(redis_server: RedisServer) -> None:
    client = Redis.from_url(redis_server.url, decode_responses=True, retry=Retry(NoBackoff(), 1))
    try:
        pipe = RedisPipe(client)
        [first] = await pipe.exchange(packed(("CLIENT", "ID")))
        await client.client_kill_filter(_id=first)
        [second] = await pipe.exchange(packed(("CLIENT", "ID")))
        assert second != first
        assert pipe.connections == 2
    finally:
        await client.aclose()


async def test_a_batch_that_outlives_the_socket_timeout_fails_and_later_batches_get_their_own_replies(
    client: Redis, redis: Redis
) -> None:
    pipe = RedisPipe(client)
    await pipe.exchange(packed(("PING",)))
    await redis.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    try:
        with pytest.raises(RedisTimeoutError):
            await pipe.exchange(packed(("ECHO", "late")))
    finally:
        await redis.execute_command("CLIENT", "UNPAUSE")
    assert await pipe.exchange(packed(("ECHO", "next"))) == ["next"]
    assert pipe.connections == 2  # the late reply died with its connection


async def test_a_cancelled_caller_does_not_shift_the_replies_of_later_batches(client: Redis) -> None:
    pipe = RedisPipe(client)
    await pipe.exchange(packed(("PING",)))  # connected
    first = asyncio.create_task(pipe.exchange(packed(("ECHO", "abandoned"))))
    await asyncio.sleep(0)
    assert pipe._protocol is not None
    assert pipe._protocol.in_flight  # written: its reply is on the way
    first.cancel()
    assert await pipe.exchange(packed(("ECHO", "mine"))) == ["mine"]
    assert pipe.connections == 1


async def test_an_unreadable_reply_drops_the_connection_and_the_next_batch_reconnects(client: Redis) -> None:
    pipe = RedisPipe(client)
    await pipe.exchange(packed(("PING",)))
    assert pipe._protocol is not None
    waiting = asyncio.create_task(pipe.exchange(packed(("ECHO", "x"))))
    await asyncio.sleep(0)
    pipe._protocol.data_received(b"!not resp\r\n")
    with pytest.raises(RedisConnectionError, match="unreadable"):
        await waiting
    assert await pipe.exchange(packed(("ECHO", "y"))) == ["y"]
    assert pipe.connections == 2


async def test_closing_the_client_closes_the_pipes_connection(
    redis_server: RedisServer, redis: Redis
) -> None:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    pipe = RedisPipe(client)
    [client_id] = await pipe.exchange(packed(("CLIENT", "ID")))
    await client.aclose()
    for _ in range(100):
        if not await redis.client_list(client_id=[client_id]):
            break
        await asyncio.sleep(0.01)
    assert await redis.client_list(client_id=[client_id]) == []


async def test_only_redis_pys_own_connections_are_piped(client: Redis) -> None:
    assert Coalescer(client).pipe is not None
    assert Coalescer(fakeredis.FakeAsyncRedis(decode_responses=True)).pipe is None
