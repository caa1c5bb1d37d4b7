"""The race storm of tests/test_races.py on a Redis Cluster, with a primary failed over in the
middle of it (`CLUSTER FAILOVER` on its replica): every question still ends with exactly one
terminal story that every path agrees on, waiters still wake with it, and no call fails."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from redis.exceptions import RedisError

from service.http.appkeys import REDIS, SWEEPER
from service.redis_client import as_cluster
from service.sweeper import Sweeper, SweepTotals
from tests.cluster.cluster_server import ClusterServer
from tests.conftest import close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import TERMINAL
from tests.test_races import QUESTIONS, STAGGER, check_counters, check_story, final_envelopes, storm

FAILOVER_AFTER = QUESTIONS * STAGGER / 3  # seconds into the storm: a third of the way


def retried_like_the_service(sweeper: Sweeper) -> None:
    """The storm calls sweep_once itself; in the service Sweeper.run retries a pass that fails
    (with backoff), and a pass can fail while a primary hands over. Do the same here."""
    once = sweeper.sweep_once

    async def sweep_once() -> SweepTotals:
        for _ in range(20):
            try:
                return await once()
            except RedisError:
                await asyncio.sleep(sweeper.interval)
        return await once()

    sweeper.sweep_once = sweep_once  # type: ignore[method-assign]


# redis-py 8.1's cluster client can drop, unclosed, a socket to the primary a failover demotes
# (a ResourceWarning at garbage collection, in redis-py, not in the service). Every assertion on
# the stories, counters and outbox below still holds; only that warning is let through.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
async def test_race_storm_with_a_failover_midway_keeps_one_terminal_story_per_question(
    cluster_server: ClusterServer,
) -> None:
    rng = random.Random(20261203)
    settings = settings_for(cluster_server.url, auth_cache_seconds=5, wait_max_seconds=15)
    first = await start_client(settings)
    second = await start_client(settings)  # a second process on the same cluster and prefix
    redis = first.server.app[REDIS]
    for app in (first.server.app, second.server.app):
        retried_like_the_service(app[SWEEPER])
    try:
        # The primary that holds bucket 0 gives way to its replica midway.
        cluster = as_cluster(redis)
        owner = cluster.get_node_from_key("{b0}")
        assert owner is not None
        replica = cluster_server.replica_of(owner.port)

        async def fail_over() -> None:
            await asyncio.sleep(FAILOVER_AFTER)
            await asyncio.to_thread(cluster_server.failover, replica)

        failing_over = asyncio.create_task(fail_over())
        stories, tokens = await storm(first, second, redis, rng)
        await failing_over
        assert cluster_server.roles()[replica] == "master"
        finals = await final_envelopes(first, stories, tokens)

        problems: list[str] = []
        outcomes: Counter[str] = Counter()
        for story in stories:
            final = finals[story.created["id"]]
            outcomes[final["state"]] += 1
            problems.extend(check_story(story, final))
        problems.extend(await check_counters(redis, settings.key_prefix, finals, outcomes))
    finally:
        await close_client(second)
        await close_client(first)

    assert not problems, f"{len(problems)} violations, first ones:\n" + "\n".join(problems[:15])
    assert sum(outcomes.values()) == QUESTIONS
    assert all(outcomes[state] > 0 for state in TERMINAL), outcomes
