"""Two service processes on one Redis: each serves waits and answers for the other's questions."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp

from service.settings import Settings
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client
from tests.redis_server import free_port


async def test_waiter_on_one_instance_wakes_from_an_answer_on_another(settings: Settings) -> None:
    first, second = await start_client(settings), await start_client(settings)
    try:
        a, b = Api(first, ADMIN_TOKEN), Api(second, ADMIN_TOKEN)
        agent = await a.principal("bot", "agent")
        alice = await a.principal("alice", "user")
        questions = [await a.ask(agent, {"user": "alice"}) for _ in range(20)]
        waits = [asyncio.create_task(a.wait(agent, q["id"], 10)) for q in questions]
        await asyncio.sleep(0.2)
        answers = await asyncio.gather(*(b.answer(alice, q["id"], "yes") for q in questions))
        # Well inside the waits' own 10 s, at whose end they would read the answers anyway.
        async with asyncio.timeout(5):
            woken = await asyncio.gather(*waits)
        for answered, waited in zip(answers, woken, strict=True):
            assert answered.body["applied"] is True
            assert waited.body == answered.body["question"]
    finally:
        await first.close()
        await second.close()


def serve(settings: Settings, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "QS_REDIS_URL": settings.redis_url,
        "QS_KEY_PREFIX": settings.key_prefix,
        "QS_ADMIN_TOKEN": ADMIN_TOKEN,
        "QS_PORT": str(port),
        "QS_REUSE_PORT": "true",
        "QS_LOG_LEVEL": "WARNING",
    }
    return subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env)


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("service did not become ready")


async def test_two_processes_share_one_port_with_reuse_port(settings: Settings) -> None:
    port = free_port()
    processes = [serve(settings, port), serve(settings, port)]
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url)
            await asyncio.sleep(0.5)  # let the second process bind too
            for pid, kind in (("bot", "agent"), ("alice", "user")):
                async with session.post(
                    url + "/v1/admin/principals", json={"id": pid, "kind": kind}, headers=admin
                ) as r:
                    assert r.status == 201
                    token = (await r.json())["token"]
                    if kind == "agent":
                        agent = {"Authorization": f"Bearer {token}"}
                    else:
                        user = {"Authorization": f"Bearer {token}"}
            ids = []
            for _ in range(30):
                body = {
                    "prompt": "Go?",
                    "options": [{"id": "y", "label": "Y"}, {"id": "n", "label": "N"}],
                    "to": {"user": "alice"},
                    "expires_in": 60,
                }
                async with session.post(url + "/v1/questions", json=body, headers=agent) as r:
                    ids.append((await r.json())["id"])

            async def wait(qid: str) -> dict[str, object]:
                async with session.get(f"{url}/v1/questions/{qid}/wait?timeout=10", headers=agent) as r:
                    return dict(await r.json())

            async def answer(qid: str) -> None:
                async with session.post(
                    f"{url}/v1/questions/{qid}/answer", json={"option": "y"}, headers=user
                ) as r:
                    assert (await r.json())["applied"] is True

            waits = [asyncio.create_task(wait(q)) for q in ids]
            await asyncio.sleep(0.3)
            await asyncio.gather(*(answer(q) for q in ids))
            results = await asyncio.gather(*waits)
        assert [r["state"] for r in results] == ["answered"] * len(ids)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=10)


async def test_room_member_answers_through_an_instance_that_never_saw_the_question(
    settings: Settings,
) -> None:
    first, second = await start_client(settings), await start_client(settings)
    try:
        a, b = Api(first, ADMIN_TOKEN), Api(second, ADMIN_TOKEN)
        agent = await a.principal("bot", "agent")
        alice = await a.principal("alice", "user")
        carol = await a.principal("carol", "user")
        await a.room("ops", ["alice"])
        question = await a.ask(agent, {"room": "ops"})
        # The member first: any earlier call through b (even a refused one) would teach b the
        # question's room, and the answer would not take the path of a process that never saw it.
        member = await b.answer(alice, question["id"], "no")
        assert member.status == 200
        assert member.body["applied"] is True
        assert member.body["question"]["answer"]["responder"] == "alice"
        outsider = await b.answer(carol, question["id"], "yes")
        assert outsider.status == 404
    finally:
        await first.close()
        await second.close()
