"""The waiters' pub/sub connection killed over and over (every 5-50 ms for seconds), while other
requests subscribe and unsubscribe and the waited questions are answered: once the kills stop,
every parked waiter returns its answer well before its own timeout."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.http.appkeys import WAITERS
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.helpers_reliability import Http, eventually, unbounded_session
from tests.redis_server import RedisServer

WAITERS_PARKED = 100
CHURN_SECONDS = 6.0
WAIT_TIMEOUT = 60.0
AFTER_CHURN = 15.0  # a quarter of the waiters' timeout: they must not have run to it


async def kill_pubsub_connections(redis: Redis, until: float) -> int:
    loop, kills = asyncio.get_running_loop(), 0
    while loop.time() < until:
        kills += await redis.client_kill_filter(_type="pubsub")
        await asyncio.sleep(random.uniform(0.005, 0.05))
    return kills


async def churn_subscriptions(http: Http, token: str, question_ids: list[str], until: float) -> None:
    """Short waits on other questions: SUBSCRIBE and UNSUBSCRIBE all through the kills. Each may
    fail (503, or a cut connection): only the parked waiters' outcome is asserted."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        question_id = random.choice(question_ids)
        await http.wait(token, question_id, random.uniform(0.01, 0.2))


async def answer_spread_over(http: Http, token: str, question_ids: list[str], seconds: float) -> None:
    for question_id in question_ids:
        await asyncio.sleep(seconds / len(question_ids))
        status, body = await http.answer(token, question_id, "yes")
        assert (status, body["applied"]) == (200, True)


async def all_within(tasks: list[asyncio.Task[tuple[int, Any]]], seconds: float) -> list[tuple[int, Any]]:
    """Every task's result, failing (and cancelling the rest) when they are not all done in time."""
    try:
        async with asyncio.timeout(seconds):
            return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class Served:
    """The app on the test's own Redis, an agent and alice, and an HTTP session to the app."""

    client: TestClient[object, object]
    http: Http
    agent: str
    alice: str

    async def ask_alice(self, count: int) -> list[str]:
        api = Api(self.client, ADMIN_TOKEN)
        return [(await api.ask(self.agent, {"user": "alice"}))["id"] for _ in range(count)]


@asynccontextmanager
async def served(redis: RedisServer) -> AsyncIterator[Served]:
    client = await start_client(test_settings(redis.url, wait_max_seconds=WAIT_TIMEOUT))
    try:
        api = Api(client, ADMIN_TOKEN)
        agent = await api.principal("agent", "agent")
        alice = await api.principal("alice", "user")
        async with unbounded_session() as session:
            yield Served(client, Http(session, client), agent, alice)
    finally:
        await close_client(client)


async def test_parked_waiters_get_their_answers_after_seconds_of_pubsub_connection_kills(
    own_redis: RedisServer, own_redis_client: Redis
) -> None:
    async with served(own_redis) as it:
        waited, churned = await it.ask_alice(WAITERS_PARKED), await it.ask_alice(20)
        waiters, http, agent, alice = it.client.server.app[WAITERS], it.http, it.agent, it.alice
        parked = [asyncio.create_task(http.wait(agent, q, WAIT_TIMEOUT)) for q in waited]

        async def all_parked() -> bool:
            return waiters.waiting >= WAITERS_PARKED

        await eventually(all_parked, within=30, what="the waiters parked")
        loop = asyncio.get_running_loop()
        until = loop.time() + CHURN_SECONDS
        kills = asyncio.create_task(kill_pubsub_connections(own_redis_client, until))
        churn = [asyncio.create_task(churn_subscriptions(http, agent, churned, until)) for _ in range(8)]
        await answer_spread_over(http, alice, waited, CHURN_SECONDS)
        assert await kills > 10
        await asyncio.gather(*churn, return_exceptions=True)
        replies = await all_within(parked, AFTER_CHURN)
        assert [status for status, _ in replies] == [200] * WAITERS_PARKED
        assert [body["state"] for _, body in replies] == ["answered"] * WAITERS_PARKED


async def test_waits_that_start_during_the_kills_end_answered_or_503_and_none_runs_to_its_timeout(
    own_redis: RedisServer, own_redis_client: Redis
) -> None:
    """A wait whose SUBSCRIBE a kill cuts gets a 503 (an outage: the client retries); every other
    wait gets its answer. None is left parked once the kills stop."""
    async with served(own_redis) as it:
        ids = await it.ask_alice(WAITERS_PARKED)
        http, agent, alice = it.http, it.agent, it.alice
        until = asyncio.get_running_loop().time() + CHURN_SECONDS

        async def wait_later(question_id: str) -> tuple[int, Any]:
            await asyncio.sleep(random.uniform(0, CHURN_SECONDS * 2 / 3))
            return await http.wait(agent, question_id, WAIT_TIMEOUT)

        async def answer_later(question_id: str) -> None:
            await asyncio.sleep(random.uniform(CHURN_SECONDS / 3, CHURN_SECONDS))
            assert (await http.answer(alice, question_id, "yes"))[0] == 200

        kills = asyncio.create_task(kill_pubsub_connections(own_redis_client, until))
        waits = [asyncio.create_task(wait_later(q)) for q in ids]
        await asyncio.gather(*(answer_later(q) for q in ids))
        assert await kills > 10
        replies = await all_within(waits, AFTER_CHURN)
        outcomes = [(status, body["state"] if status == 200 else None) for status, body in replies]
        assert set(outcomes) <= {(200, "answered"), (503, None)}
        assert outcomes.count((200, "answered")) >= WAITERS_PARKED // 2
        for question_id, (status, _) in zip(ids, replies, strict=True):
            if status == 503:  # the client's retry
                assert (await http.wait(agent, question_id, 1))[1]["state"] == "answered"
        assert it.client.server.app[WAITERS].waiting == 0
