"""POST /v1/questions/wait: one long-poll for a fleet's many questions, in 'any' or 'all' mode."""

from __future__ import annotations

import asyncio

import pytest

from service.http.appkeys import DIRECTORY
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
    # A wait that parked would also meet the condition, at its 30 s timeout: hence the bound.
    async with asyncio.timeout(5):
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


async def test_a_room_member_batch_waits_room_questions_and_a_non_member_is_refused_them(api: Api) -> None:
    agent = await api.principal("fleet", "agent")
    alice = await api.principal("alice", "user")
    bob = await api.principal("bob", "user")
    await api.room("ops", ["alice"])
    await api.room("dev", ["alice", "bob"])
    ops = (await api.ask(agent, {"room": "ops"}))["id"]
    dev = (await api.ask(agent, {"room": "dev"}))["id"]
    waiting = asyncio.create_task(batch_wait(api, alice, [ops, dev], 10, "any"))
    await asyncio.sleep(0.2)
    await api.answer(bob, dev, "no")
    reply = await asyncio.wait_for(waiting, 5)
    assert reply.status == 200
    assert [item["state"] for item in reply.body["items"]] == ["pending", "answered"]
    refused = await batch_wait(api, bob, [dev, ops], 1, "any")
    assert refused.status == 404
    assert ops in refused.body["detail"]
    assert dev not in refused.body["detail"]


async def test_a_batch_of_room_questions_reads_each_room_membership_once_and_all_at_once(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = await api.principal("fleet", "agent")
    alice = await api.principal("alice", "user")
    rooms = ["r1", "r2", "r3"]
    for room in rooms:
        await api.room(room, ["alice"])
    ids = [(await api.ask(agent, {"room": room}))["id"] for room in rooms for _ in range(3)]
    directory = api.client.server.app[DIRECTORY]
    is_member = directory.is_member
    reads: list[str] = []
    in_flight = most_in_flight = 0

    async def counting_is_member(room: str, user: str) -> bool:
        nonlocal in_flight, most_in_flight
        reads.append(room)
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        try:
            return await is_member(room, user)
        finally:
            in_flight -= 1

    monkeypatch.setattr(directory, "is_member", counting_is_member)
    reply = await batch_wait(api, alice, ids, 0, "any")
    assert reply.status == 200
    assert sorted(reads) == rooms  # once per room, not once per question
    assert most_in_flight == len(rooms)  # in flight together: one coalesced round trip
