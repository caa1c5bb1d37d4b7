"""The coalescer's one pipelined connection on one Redis node (service/redis_pipe.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import fakeredis
import hiredis
import pytest
import trustme
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.coalesce import Coalescer
from service.redis_pipe import RedisPipe
from tests.redis_server import RedisServer, free_port

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


@pytest.fixture(scope="module")
def transports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, dict[str, Any]]]]:
    """One redis-server listening on TLS and on a Unix socket too: URL and client options of each."""
    files = tmp_path_factory.mktemp("pipe")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(files / "ca.pem"))
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(files / "cert.pem"))
    issued.private_key_pem.write_to_path(str(files / "key.pem"))
    tls_port, socket = free_port(), files / "redis.sock"
    server = RedisServer(
        "--tls-port", str(tls_port), "--tls-cert-file", str(files / "cert.pem"),
        "--tls-key-file", str(files / "key.pem"), "--tls-ca-cert-file", str(files / "ca.pem"),
        "--tls-auth-clients", "no", "--unixsocket", str(socket), "--unixsocketperm", "700",
    ).start()  # fmt: skip
    yield {
        "tls": (f"rediss://127.0.0.1:{tls_port}/0", {"ssl_ca_certs": str(files / "ca.pem")}),
        "unix": (f"unix://{socket}?db=0", {}),
    }
    server.cleanup()


@pytest.mark.parametrize("transport", ["tls", "unix"])
async def test_the_pipe_carries_batches_over_tls_and_unix_sockets_and_survives_a_killed_connection(
    transports: dict[str, tuple[str, dict[str, Any]]], transport: str
) -> None:
    url, options = transports[transport]
    client = Redis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 1), **options)
    try:
        assert RedisPipe.supports(client)
        pipe = RedisPipe(client)
        replies = await asyncio.gather(
            *(pipe.exchange(packed(("CLIENT", "ID"), ("ECHO", str(i)))) for i in range(5))
        )
        assert [echo for _, echo in replies] == [str(i) for i in range(5)]
        [first_id] = {client_id for client_id, _ in replies}
        await client.client_kill_filter(_id=first_id)
        second_id, echo = await pipe.exchange(packed(("CLIENT", "ID"), ("ECHO", "again")))
        assert (echo, pipe.connections) == ("again", 2)
        assert second_id != first_id
    finally:
        await client.aclose()
