"""At start and on /readyz the service says when the Redis it was given can lose questions
(an evicting maxmemory-policy, no persistence) or expire them late (no keyspace notifications):
a warning in the log and in /readyz, which stays 200 unless QS_READY_REQUIRES_SAFE_REDIS."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from service.settings import MEMORY_URL
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.redis_server import RedisServer

SAFE = ("--appendonly", "yes", "--notify-keyspace-events", "Ex")


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A redis-server of its own, started with the test's parameters."""
    started = RedisServer(*request.param).start()
    yield started
    started.cleanup()


async def readyz(url: str, **changes: Any) -> tuple[int, dict[str, Any]]:
    client = await start_client(settings_for(url, **changes))
    try:
        reply = await Api(client, ADMIN_TOKEN).call("GET", "/readyz")
        return reply.status, reply.body
    finally:
        await close_client(client)


def states(body: dict[str, Any]) -> dict[str, str]:
    return {name: check["state"] for name, check in body["checks"].items()}


@pytest.mark.parametrize("server", [SAFE], indirect=True)
async def test_a_safe_redis_passes_every_check_without_warnings(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    status, body = await readyz(server.url)
    assert status == 200
    assert body["status"] == "ready"
    assert states(body) == {"maxmemory_policy": "ok", "persistence": "ok", "keyspace_notifications": "ok"}
    assert body["warnings"] == []
    assert not [r for r in caplog.records if r.name == "service.http.app" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("server", [("--maxmemory-policy", "allkeys-lru")], indirect=True)
async def test_eviction_and_no_persistence_are_warnings_in_the_log_and_in_readyz(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    status, body = await readyz(server.url)
    assert status == 200
    assert states(body)["maxmemory_policy"] == "at_risk"
    assert "allkeys-lru" in body["checks"]["maxmemory_policy"]["detail"]
    assert states(body)["persistence"] == "at_risk"
    assert len(body["warnings"]) == 2
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("Redis maxmemory_policy at_risk: ") for m in logged), logged
    assert any(m.startswith("Redis persistence at_risk: ") for m in logged), logged


@pytest.mark.parametrize("server", [("--maxmemory-policy", "volatile-ttl")], indirect=True)
async def test_strict_readiness_refuses_a_redis_that_can_lose_questions(server: RedisServer) -> None:
    status, body = await readyz(server.url, ready_requires_safe_redis=True)
    assert status == 503
    assert body["type"].endswith("/unavailable")
    assert "maxmemory_policy" in body["detail"]
    assert "persistence" in body["detail"]


@pytest.mark.parametrize("server", [SAFE], indirect=True)
async def test_strict_readiness_accepts_a_safe_redis(server: RedisServer) -> None:
    status, _ = await readyz(server.url, ready_requires_safe_redis=True)
    assert status == 200


@pytest.mark.parametrize("server", [("--save", "3600 1")], indirect=True)
async def test_rdb_snapshots_alone_are_degraded_not_lossy(server: RedisServer) -> None:
    status, body = await readyz(server.url, ready_requires_safe_redis=True)
    assert status == 200
    assert states(body)["persistence"] == "degraded"


@pytest.mark.parametrize("server", [("--appendonly", "yes")], indirect=True)
async def test_keyspace_notifications_left_off_are_degraded(server: RedisServer) -> None:
    status, body = await readyz(server.url, keyspace_notifications=False)
    assert status == 200
    assert states(body)["keyspace_notifications"] == "degraded"
    assert "sweeper alone" in body["checks"]["keyspace_notifications"]["detail"]
    # With the listener on, the service turns them on at start, so the check then passes.
    _, enabled = await readyz(server.url)
    assert states(enabled)["keyspace_notifications"] == "ok"


@pytest.mark.parametrize("server", [("--rename-command", "CONFIG", "")], indirect=True)
async def test_a_redis_that_refuses_config_is_reported_as_unknown(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    status, body = await readyz(server.url)
    assert status == 200
    assert states(body) == {
        "maxmemory_policy": "ok",
        "persistence": "unknown",
        "keyspace_notifications": "unknown",
    }
    assert any("cannot enable keyspace notifications" in r.getMessage() for r in caplog.records)


async def test_the_in_memory_backend_is_reported_as_keeping_nothing() -> None:
    status, body = await readyz(MEMORY_URL)
    assert status == 200
    assert states(body) == {"backend": "at_risk"}
