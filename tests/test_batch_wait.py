"""POST /v1/questions/wait: one long-poll for a fleet's many questions, in 'any' or 'all' mode."""

from __future__ import annotations

import asyncio

from tests.api import Api


async def setup(api: Api, count: int) -> tuple[str, str, list[str]]:
    agent = await api.principal("fleet", "agent")
    alice = await api.principal("alice", "user")
    ids = [(await api.ask(agent, {"user": "alice"}))["id"] for _ in range(count)]
    return agent, alice, ids


async def batch_wait(api: Api, token: str, ids: list[str], timeout: float, mode: str):  # type: ignore[no-untyped-def]
    return await api.call("POST", "/v1/questions/wait", token, {"ids": ids, "timeout": timeout, "mode": mode})


async def test_any_mode_returns_when_the_first_question_is_answered(api: Api) -> None:
    agent, alice, ids = await setup(api, 3)
    waiting = asyncio.create_task(batch_wait(api, agent, ids, 10, "any"))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await api.answer(alice, ids[1], "yes")
    reply = await asyncio.wait_for(waiting, 5)
    assert reply.status == 200
    assert reply.body["condition_met"] is True
    assert [item["id"] for item in reply.body["items"]] == ids
    assert [item["state"] for item in reply.body["items"]] == ["pending", "answered", "pending"]


async def test_all_mode_waits_for_every_question(api: Api) -> None:
    agent, alice, ids = await setup(api, 3)
    waiting = asyncio.create_task(batch_wait(api, agent, ids, 10, "all"))
    await api.answer(alice, ids[0], "yes")
    await api.cancel(agent, ids[1])
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await api.answer(alice, ids[2], "no")
    reply = await asyncio.wait_for(waiting, 5)
    assert reply.body["condition_met"] is True
    assert [item["state"] for item in reply.body["items"]] == ["answered", "cancelled", "answered"]
    for item in reply.body["items"]:
        assert (await api.get(agent, item["id"])).body == item


async def test_timeout_lists_pending_questions_as_pending(api: Api) -> None:
    agent, _, ids = await setup(api, 2)
    reply = await batch_wait(api, agent, ids, 0.3, "any")
    assert reply.status == 200
    assert reply.body["condition_met"] is False
    assert [item["state"] for item in reply.body["items"]] == ["pending", "pending"]


async def test_already_terminal_questions_return_at_once(api: Api) -> None:
    agent, alice, ids = await setup(api, 2)
    await api.answer(alice, ids[0], "yes")
    reply = await batch_wait(api, agent, ids, 30, "any")
    assert reply.body["condition_met"] is True


async def test_a_question_the_caller_cannot_see_is_404_and_names_it(api: Api) -> None:
    agent, _, ids = await setup(api, 1)
    other = await api.principal("other", "agent")
    reply = await batch_wait(api, other, ids, 1, "any")
    assert reply.status == 404
    assert ids[0] in reply.body["detail"]
    unknown = await batch_wait(api, agent, [*ids, "f" * 25], 1, "any")
    assert unknown.status == 404


async def test_more_than_100_ids_or_a_bad_mode_is_refused(api: Api) -> None:
    agent, _, ids = await setup(api, 1)
    too_many = await batch_wait(api, agent, ids * 101, 1, "any")
    assert too_many.status == 422
    bad_mode = await batch_wait(api, agent, ids, 1, "some")
    assert bad_mode.status == 422
    empty = await batch_wait(api, agent, [], 1, "any")
    assert empty.status == 422
