"""QS_QUESTIONS_PER_AGENT: the questions one agent keeps, checked per bucket inside create.lua."""

from __future__ import annotations

from collections import Counter

from redis.asyncio import Redis

from service.http.appkeys import SETTINGS
from service.keys import BUCKETS, Keys, bucket_of
from tests.api import Api, Reply
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.helpers_reliability import ask_body
from tests.redis_server import RedisServer

ASKS = 60  # with one place per bucket, some of these land in a bucket already taken


async def ask(api: Api, token: str, idempotency_key: str | None = None) -> Reply:
    headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
    return await api.call("POST", "/v1/questions", token, ask_body({"user": "alice"}), headers=headers)


async def test_an_agent_at_its_cap_gets_429_and_nothing_is_written_while_others_still_ask(
    redis_server: RedisServer, redis: Redis
) -> None:
    client = await start_client(test_settings(redis_server.url, questions_per_agent=BUCKETS))
    try:
        api = Api(client, ADMIN_TOKEN)
        keys = Keys(client.server.app[SETTINGS].key_prefix)
        fleet = await api.principal("fleet", "agent")
        other = await api.principal("other", "agent")
        await api.principal("alice", "user")
        replies = [await ask(api, fleet) for _ in range(ASKS)]

        created = [r.body["id"] for r in replies if r.status == 201]
        refused = [r for r in replies if r.status != 201]
        per_bucket = Counter(bucket_of(q) for q in created)
        assert max(per_bucket.values()) == 1  # one place per bucket, none taken twice
        assert len(created) + len(refused) == ASKS
        assert refused  # 60 asks for 16 places: some must be refused
        assert {r.status for r in refused} == {429}
        assert {r.body["type"].rsplit("/", 1)[1] for r in refused} == {"too-many-questions"}
        created_total = sum([int(await redis.hget(keys.stats(b), "created") or 0) for b in range(BUCKETS)])
        assert created_total == len(created)  # a refusal writes nothing, not even a counter
        assert (await api.ask(other, {"user": "alice"}))["state"] == "pending"  # the cap is per agent
    finally:
        await close_client(client)


async def test_an_idempotent_retry_of_a_kept_question_is_answered_even_at_the_cap(
    redis_server: RedisServer,
) -> None:
    client = await start_client(test_settings(redis_server.url, questions_per_agent=BUCKETS))
    try:
        api = Api(client, ADMIN_TOKEN)
        fleet = await api.principal("fleet", "agent")
        await api.principal("alice", "user")
        first = await ask(api, fleet, "deploy-1432")
        assert first.status == 201
        for _ in range(ASKS):
            await ask(api, fleet)  # the first's bucket too is taken (by it) from the start
        again = await ask(api, fleet, "deploy-1432")
        assert (again.status, again.body["id"]) == (200, first.body["id"])
    finally:
        await close_client(client)
