"""A graceful failover (`CLUSTER FAILOVER` on a replica) under parked waiters and live calls:
the promoted replica gets the scripts on its first NOSCRIPT, the sharded subscriptions move to
it, every waiter wakes, and no call fails."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient

from service.http.appkeys import REDIS, STORE, WAITERS
from service.redis_client import as_cluster
from tests.api import Api
from tests.cluster.cluster_server import ClusterServer
from tests.cluster.test_cluster_protocol import setup_people, wait_for_waiters


async def test_waiters_wake_and_calls_succeed_across_a_failover_of_their_primary(
    cluster_server: ClusterServer, cluster_client: TestClient[object, object], cluster_api: Api
) -> None:
    tokens = await setup_people(cluster_api)
    app = cluster_client.server.app
    asked = await asyncio.gather(*(cluster_api.ask(tokens["agent"], {"user": "alice"}) for _ in range(30)))
    ids = [q["id"] for q in asked]
    cluster = as_cluster(app[REDIS])
    owner = cluster.get_node_from_key(app[STORE].keys.for_question(ids[0]).question)
    assert owner is not None
    on_owner = [
        q for q in ids if cluster.get_node_from_key(app[STORE].keys.for_question(q).question) == owner
    ]
    waits = [asyncio.create_task(cluster_api.wait(tokens["agent"], q, 20)) for q in ids]
    await wait_for_waiters(cluster_client, len(ids))
    resubscribed = app[WAITERS].resubscriptions

    await asyncio.to_thread(cluster_server.failover, cluster_server.replica_of(owner.port))

    answers = await asyncio.gather(*(cluster_api.answer(tokens["alice"], q, "yes") for q in ids))
    assert [(a.status, a.body["applied"]) for a in answers] == [(200, True)] * len(ids)
    woken = await asyncio.gather(*waits)
    assert [w.body["state"] for w in woken] == ["answered"] * len(ids)
    assert on_owner
    # The moved subscriptions were confirmed again, which re-reads the questions behind them.
    assert app[WAITERS].resubscriptions > resubscribed
    created = await cluster_api.ask(tokens["agent"], {"user": "alice"})
    assert created["state"] == "pending"
