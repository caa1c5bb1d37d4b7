"""A Redis that is there but refuses (out of memory, a read-only replica, a cluster without
quorum, ...) is an outage: 503 with Retry-After, the same as an unreachable one, never a 500."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis._parsers.base import BaseParser
from redis.asyncio import Redis

from service.redis_client import refused_for_now
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis
ASK = {
    "prompt": "Proceed?",
    "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
    "to": {"user": "alice"},
    "expires_in": 60,
}


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own: it is made to refuse writes."""
    started = RedisServer().start()
    yield started
    started.cleanup()


@pytest.mark.parametrize(
    "reply",
    [
        "OOM command not allowed when used memory > 'maxmemory'.",
        "READONLY You can't write against a read only replica.",
        "CLUSTERDOWN The cluster is down",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        "NOREPLICAS Not enough good replicas to write.",
        "BUSY Redis is busy running a script.",
    ],
)
def test_every_refusal_reply_is_an_outage_as_redis_py_parses_it(reply: str) -> None:
    assert refused_for_now(BaseParser.parse_error(reply))


@pytest.mark.parametrize(
    "reply",
    ["ERR unknown command 'NOPE'", "WRONGTYPE Operation against a key holding the wrong kind of value"],
)
def test_a_misuse_reply_is_not_an_outage(reply: str) -> None:
    assert not refused_for_now(BaseParser.parse_error(reply))


async def test_a_redis_out_of_memory_gets_503s_for_scripts_and_plain_writes_then_serves_again(
    own_server: RedisServer,
) -> None:
    client = await start_client(test_settings(own_server.url))
    control = Redis.from_url(own_server.url)
    try:
        api = Api(client, ADMIN_TOKEN)
        agent = await api.principal("deploybot", "agent")
        alice = await api.principal("alice", "user")
        question = await api.ask(agent, {"user": "alice"})
        await control.config_set("maxmemory", 1)
        refused = [
            await api.call("POST", "/v1/questions", agent, ASK),
            await api.answer(alice, question["id"], "yes"),
            await api.call("POST", "/v1/admin/principals", api.admin, {"id": "bob", "kind": "user"}),
        ]
        for reply in refused:
            assert reply.status == 503, reply.body
            assert reply.headers["Retry-After"] == "1"
            assert reply.body["type"].endswith("/unavailable")
        read = await api.get(agent, question["id"])  # reads keep working (docs/operations.md)
        assert read.status == 200, read.body
        assert read.body["state"] == "pending"
        await control.config_set("maxmemory", 0)
        answered = await api.answer(alice, question["id"], "yes")
        assert answered.status == 200
        assert answered.body["applied"] is True
    finally:
        await control.aclose()
        await close_client(client)
