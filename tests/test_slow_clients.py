"""A client that holds a connection without finishing a request is cut off: idle, or trickling
its headers a byte at a time (the body has its own limit, QS_BODY_TIMEOUT_SECONDS: 408)."""

from __future__ import annotations

import asyncio

from tests.conftest import test_settings
from tests.live_service import serve
from tests.redis_server import RedisServer

KEEPALIVE = 0.5
WITHIN = 10.0  # far above KEEPALIVE: only "closed at all" is asserted, not how fast


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_an_idle_connection_is_closed_after_the_keepalive_time(redis_server: RedisServer) -> None:
    async with serve(test_settings(redis_server.url, keepalive_seconds=KEEPALIVE)) as url:
        reader, writer = await connect(url)
        assert await asyncio.wait_for(reader.read(), WITHIN) == b""
        writer.close()


async def test_request_headers_trickled_a_byte_at_a_time_are_cut_off(redis_server: RedisServer) -> None:
    async with serve(test_settings(redis_server.url, keepalive_seconds=KEEPALIVE)) as url:
        reader, writer = await connect(url)
        headers = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000

        async def trickle() -> None:
            for i in range(len(headers)):  # 50 s for the whole header block at this pace
                writer.write(headers[i : i + 1])
                await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        assert await asyncio.wait_for(reader.read(), WITHIN) == b""
        assert not trickling.done()  # cut off mid-headers
        trickling.cancel()
        await asyncio.gather(trickling, return_exceptions=True)
        writer.close()


async def test_a_complete_request_is_served_on_the_same_settings(redis_server: RedisServer) -> None:
    async with serve(test_settings(redis_server.url, keepalive_seconds=KEEPALIVE)) as url:
        reader, writer = await connect(url)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), WITHIN)
        assert status.startswith(b"HTTP/1.1 200")
        writer.close()
