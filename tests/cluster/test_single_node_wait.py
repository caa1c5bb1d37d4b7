"""QS_WAIT_REPLICAS on a single primary with one replica (no cluster): answers and cancels are
confirmed by the replica; asking for more replicas than exist is counted, never an error."""

from __future__ import annotations

import asyncio

from service.http.appkeys import SCRIPTS
from tests.api import Api
from tests.cluster.cluster_server import command
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.helpers_reliability import eventually
from tests.redis_server import RedisServer


async def replica_linked(replica: RedisServer) -> None:
    async def linked() -> bool:
        info = await asyncio.to_thread(command, replica.port, "info", "replication")
        return "master_link_status:up" in info

    await eventually(linked, within=20, what="the replica linked to its primary")


async def test_wait_replicas_on_a_single_primary_confirms_or_counts_each_answer_and_cancel() -> None:
    primary = RedisServer().start()
    replica = RedisServer("--replicaof", "127.0.0.1", str(primary.port)).start()
    try:
        await replica_linked(replica)
        for replicas, confirmed in ((1, True), (2, False)):
            settings = test_settings(primary.url, wait_replicas=replicas, wait_timeout_ms=300)
            client = await start_client(settings)
            try:
                api = Api(client, ADMIN_TOKEN)
                agent = await api.principal("agent", "agent")
                alice = await api.principal("alice", "user")
                asked = [await api.ask(agent, {"user": "alice"}) for _ in range(6)]
                answered = await asyncio.gather(*(api.answer(alice, q["id"], "yes") for q in asked[:3]))
                cancelled = await asyncio.gather(*(api.cancel(agent, q["id"]) for q in asked[3:]))
                assert [r.body["applied"] for r in (*answered, *cancelled)] == [True] * 6
                unconfirmed = client.server.app[SCRIPTS].coalescer.replication_unconfirmed
                assert (unconfirmed == 0) is confirmed, unconfirmed
            finally:
                await close_client(client)
    finally:
        replica.cleanup()
        primary.cleanup()
