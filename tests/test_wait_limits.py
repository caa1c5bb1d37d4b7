"""QS_WAITS_PER_PRINCIPAL: how many long polls one principal may hold parked in one process."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from service.__main__ import server_options
from service.http.app import create_app
from service.http.appkeys import QUESTIONS
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings
from tests.helpers_reliability import ask_body, eventually
from tests.live_service import on_loopback
from tests.redis_server import RedisServer


async def until_parked(app: web.Application, principal: str, count: int) -> None:
    async def parked() -> bool:
        return app[QUESTIONS].parked.get(principal, 0) == count

    await eventually(parked, within=10, what=f"{count} waits of {principal} parked")


async def test_a_principal_beyond_its_parked_wait_limit_gets_429_until_one_returns(
    redis_server: RedisServer,
) -> None:
    client = await start_client(test_settings(redis_server.url, waits_per_principal=2))
    app = client.server.app
    try:
        api = Api(client, ADMIN_TOKEN)
        agent = await api.principal("fleet", "agent")
        alice = await api.principal("alice", "user")
        ids = [(await api.ask(agent, {"user": "alice"}))["id"] for _ in range(4)]
        single = asyncio.create_task(api.wait(agent, ids[0], 10))
        batch = asyncio.create_task(
            api.call("POST", "/v1/questions/wait", agent, {"ids": ids[1:3], "timeout": 10, "mode": "any"})
        )
        await until_parked(app, "fleet", 2)

        refused = await api.wait(agent, ids[3], 10)
        assert refused.status == 429
        assert refused.body["type"].endswith("/too-many-waits")
        refused_batch = await api.call("POST", "/v1/questions/wait", agent, {"ids": ids[3:], "timeout": 10})
        assert refused_batch.status == 429
        # A wait that needs no parking is never refused: this one is already over.
        await api.cancel(agent, ids[3])
        assert (await api.wait(agent, ids[3], 10)).body["state"] == "cancelled"
        # The limit is the principal's own: alice still parks (and times out) on her question.
        assert (await api.wait(alice, ids[0], 0.2)).body["state"] == "pending"

        await api.answer(alice, ids[0], "yes")
        assert (await single).body["state"] == "answered"
        await until_parked(app, "fleet", 1)
        again = asyncio.create_task(api.wait(agent, ids[1], 10))
        await until_parked(app, "fleet", 2)
        await api.answer(alice, ids[1], "no")
        assert (await again).body["state"] == "answered"
        assert (await batch).body["condition_met"] is True
        assert app[QUESTIONS].parked == {}
    finally:
        await close_client(client)


async def test_a_client_that_hangs_up_gives_its_parked_wait_place_back(redis_server: RedisServer) -> None:
    settings = test_settings(redis_server.url, waits_per_principal=1)
    app = create_app(settings)
    async with on_loopback(app, **server_options(settings)) as url, aiohttp.ClientSession(url) as http:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        tokens = {}
        for name, kind in (("fleet", "agent"), ("alice", "user")):
            async with http.post("/v1/admin/principals", json={"id": name, "kind": kind}, headers=admin) as r:
                tokens[name] = (await r.json())["token"]
        agent = {"Authorization": f"Bearer {tokens['fleet']}"}
        async with http.post("/v1/questions", json=ask_body({"user": "alice"}), headers=agent) as r:
            question_id = (await r.json())["id"]

        async def wait(timeout: float) -> int:
            path = f"/v1/questions/{question_id}/wait?timeout={timeout}"
            async with http.get(path, headers=agent) as reply:
                return reply.status

        hung_up = asyncio.create_task(wait(10))
        await until_parked(app, "fleet", 1)
        assert await wait(10) == 429
        hung_up.cancel()  # closes its connection; the server cancels the parked handler
        await until_parked(app, "fleet", 0)
        assert await wait(0.2) == 200
        assert app[QUESTIONS].parked == {}
