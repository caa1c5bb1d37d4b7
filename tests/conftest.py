"""Shared fixtures: a real redis-server per session, a fresh key prefix per test, the app."""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from service.http.app import create_app
from service.settings import MEMORY_URL, Settings
from tests.api import Api
from tests.redis_server import RedisServer

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


def test_settings(redis_url: str, **changes: object) -> Settings:
    """Settings for one test: its own key prefix, so tests never see each other's keys."""
    base = Settings(
        redis_url=redis_url,
        key_prefix=f"t{uuid.uuid4().hex[:12]}",
        admin_token=ADMIN_TOKEN,
        auth_cache_seconds=0,
        sweep_interval_seconds=0.2,
        wait_max_seconds=10,
        wait_default_seconds=5,
    )
    return base.replace(**changes)


test_settings.__test__ = False  # type: ignore[attr-defined]  # a factory, not a test


@pytest.fixture
def settings(redis_server: RedisServer) -> Settings:
    return test_settings(redis_server.url)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


async def start_client(settings: Settings) -> TestClient[object, object]:
    client: TestClient[object, object] = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    return client


async def close_client(client: TestClient[object, object], within: float = 20.0) -> None:
    """Close the app; if that hangs, fail with every task's stack instead of a bare timeout."""
    closing = asyncio.ensure_future(client.close())
    done, _ = await asyncio.wait([closing], timeout=within)
    if not done:
        stacks = io.StringIO()
        for task in asyncio.all_tasks():
            task.print_stack(limit=30, file=stacks)
        raise AssertionError(f"app shutdown hung for {within} s; tasks:\n{stacks.getvalue()}")
    closing.result()


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[TestClient[object, object]]:
    c = await start_client(settings)
    yield c
    await close_client(c)


@pytest.fixture
async def api(client: TestClient[object, object]) -> Api:
    return Api(client, ADMIN_TOKEN)


@pytest.fixture(params=["redis", "memory"])
async def any_api(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Api]:
    """The same API on a real Redis and on the in-memory fakeredis backend."""
    real = request.param == "redis"
    url = request.getfixturevalue("redis_server").url if real else MEMORY_URL
    c = await start_client(test_settings(url))
    yield Api(c, ADMIN_TOKEN)
    await close_client(c)
