"""Chaos-only fixtures: a Redis of the test's own (so killing its clients or the server touches no
other test), a fault-injecting proxy in front of it, and subprocesses stopped at teardown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bench.procs import Proc, raise_fd_limit
from tests.chaos.proxy import Proxy
from tests.redis_server import RedisServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A fresh redis-server for this test alone, with keyspace expiry events on."""
    server = RedisServer("--notify-keyspace-events", "Ex", "--maxclients", "20000").start()
    yield server
    server.cleanup()


@pytest.fixture
async def own_redis_client(own_redis: RedisServer) -> AsyncIterator[Redis]:
    """A plain client of `own_redis`, for reading the truth behind the service."""
    client = Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def proxy(own_redis: RedisServer) -> AsyncIterator[Proxy]:
    """A TCP proxy in front of `own_redis`; see tests/chaos/proxy.py for its faults."""
    p = await Proxy(own_redis.port).start()
    yield p
    await p.stop()


class Processes:
    """Subprocesses a test starts; every one is stopped (by its own pid) at teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Proc] = []

    def start(self, proc: Proc) -> Proc:
        self.started.append(proc)
        proc.start()
        return proc

    def subdir(self, name: str) -> Path:
        """A folder of its own for one process's log (bench.procs names logs by process name,
        but ServiceProc loses its name to a loop variable, so two services would share one)."""
        path = self.workdir / name
        path.mkdir(exist_ok=True)
        return path

    async def start_async(self, proc: Proc) -> Proc:
        """start() in a thread: it blocks until the process answers, and the process may need
        this event loop meanwhile (a proxy in front of its Redis)."""
        return await asyncio.to_thread(self.start, proc)

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop(timeout=5.0)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="session")
def fd_limit() -> int:
    """The open-files limit, raised as far as the hard limit allows (children inherit it)."""
    return raise_fd_limit()
