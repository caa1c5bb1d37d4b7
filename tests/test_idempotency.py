"""Agents' retries: one Idempotency-Key, one question, however many times and however encoded;
and an answer or cancel sent again with its key is told what its first try did."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiohttp.test_utils import TestClient
from redis.asyncio import Redis

from service.settings import Settings
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, start_client
from tests.helpers_reliability import Http, ask_body, outbox_events, stats_totals, unbounded_session


async def people(api: Api) -> tuple[str, str]:
    agent = await api.principal("deploybot", "agent")
    await api.principal("alice", "user")
    return agent, await api.principal("otherbot", "agent")


async def test_same_key_fired_50_times_concurrently_creates_exactly_one_question(
    api: Api, client: TestClient[object, object], settings: Settings, redis: Redis
) -> None:
    agent, _ = await people(api)
    second = await start_client(settings)  # a second process on the same Redis and prefix
    try:
        body = ask_body({"user": "alice"}, options=("ship", "hold"), metadata={"build": 42})
        headers = {"Idempotency-Key": "deploy-42-attempt"}
        async with unbounded_session() as session:
            apps = [Http(session, client), Http(session, second)]
            replies = await asyncio.gather(
                *(apps[i % 2].call("POST", "/v1/questions", agent, body, headers) for i in range(50))
            )
    finally:
        await second.close()

    statuses = Counter(status for status, _ in replies)
    assert statuses == {201: 1, 200: 49}
    envelopes = [envelope for _, envelope in replies]
    assert all(e == envelopes[0] for e in envelopes)
    assert envelopes[0]["state"] == "pending"
    assert envelopes[0]["metadata"] == {"build": 42}

    listed = await api.list(agent, role="asker")
    assert [q["id"] for q in listed.body["items"]] == [envelopes[0]["id"]]
    assert (await stats_totals(redis, settings.key_prefix))["created"] == 1
    created = [e for e in await outbox_events(redis, settings.key_prefix) if e["type"] == "question.created"]
    assert [e["id"] for e in created] == [envelopes[0]["id"]]


async def test_replay_returns_200_with_the_original_envelope_and_location(api: Api) -> None:
    agent, _ = await people(api)
    headers = {"Idempotency-Key": "k-1"}
    body = ask_body({"user": "alice"})
    first = await api.call("POST", "/v1/questions", agent, body, headers=headers)
    again = await api.call("POST", "/v1/questions", agent, body, headers=headers)
    assert (first.status, again.status) == (201, 200)
    assert again.body == first.body
    assert again.headers["Location"] == first.headers["Location"] == f"/v1/questions/{first.body['id']}"


@pytest.mark.parametrize(
    "changes",
    [{"options": ("yes", "no", "later")}, {"webhook_url": "https://example.com/hook"}],
    ids=["options", "webhook-url"],
)
async def test_same_key_with_a_different_body_is_refused_with_422_and_writes_nothing(
    api: Api, settings: Settings, redis: Redis, changes: dict[str, object]
) -> None:
    agent, _ = await people(api)
    headers = {"Idempotency-Key": "k-2"}
    first = await api.call("POST", "/v1/questions", agent, ask_body({"user": "alice"}), headers=headers)
    assert first.status == 201
    stats_before = await stats_totals(redis, settings.key_prefix)

    changed = ask_body({"user": "alice"}, **changes)
    reply = await api.call("POST", "/v1/questions", agent, changed, headers=headers)

    assert reply.status == 422
    assert reply.headers["Content-Type"].startswith("application/problem+json")
    assert reply.body["status"] == 422
    assert await stats_totals(redis, settings.key_prefix) == stats_before
    listed = await api.list(agent, role="asker")
    assert [q["id"] for q in listed.body["items"]] == [first.body["id"]]


async def test_concurrent_different_bodies_under_one_key_create_one_question_and_refuse_the_rest(
    api: Api, client: TestClient[object, object], settings: Settings, redis: Redis
) -> None:
    agent, _ = await people(api)
    headers = {"Idempotency-Key": "k-contended"}
    bodies = [ask_body({"user": "alice"}, prompt=f"variant {i % 5}") for i in range(30)]
    async with unbounded_session() as session:
        http = Http(session, client)
        replies = await asyncio.gather(
            *(http.call("POST", "/v1/questions", agent, b, headers) for b in bodies)
        )

    winner = next(body for (status, _), body in zip(replies, bodies, strict=True) if status == 201)
    for (status, reply), body in zip(replies, bodies, strict=True):
        if body == winner:
            assert status in (200, 201)
        else:
            assert status == 422, reply
    assert [s for s, _ in replies].count(201) == 1
    assert (await stats_totals(redis, settings.key_prefix))["created"] == 1


async def test_a_different_agent_with_the_same_key_gets_its_own_question(api: Api) -> None:
    agent, other = await people(api)
    headers = {"Idempotency-Key": "shared-key"}
    body = ask_body({"user": "alice"})

    mine = await api.call("POST", "/v1/questions", agent, body, headers=headers)
    theirs = await api.call("POST", "/v1/questions", other, body, headers=headers)
    theirs_again = await api.call("POST", "/v1/questions", other, body, headers=headers)
    mine_again = await api.call("POST", "/v1/questions", agent, body, headers=headers)

    assert (mine.status, theirs.status, theirs_again.status, mine_again.status) == (201, 201, 200, 200)
    assert theirs.body["id"] != mine.body["id"]
    assert theirs.body["asker"] == "otherbot"
    assert mine.body["asker"] == "deploybot"
    assert theirs_again.body == theirs.body
    assert mine_again.body == mine.body


async def test_json_and_msgpack_of_the_same_body_count_as_the_same_request(api: Api) -> None:
    agent, _ = await people(api)
    body = ask_body({"user": "alice"}, options=("go", "stop"), metadata={"nested": {"a": [1, 2]}})

    first = await api.call("POST", "/v1/questions", agent, body, headers={"Idempotency-Key": "enc-1"})
    packed = await api.call(
        "POST",
        "/v1/questions",
        agent,
        body,
        headers={"Idempotency-Key": "enc-1"},
        content_type="application/msgpack",
    )
    assert (first.status, packed.status) == (201, 200)
    assert packed.body == first.body

    # The other way round, with a msgpack reply: still one question, the same content.
    packed_first = await api.call(
        "POST",
        "/v1/questions",
        agent,
        body,
        headers={"Idempotency-Key": "enc-2"},
        content_type="application/msgpack",
        msgpack_reply=True,
    )
    as_json = await api.call("POST", "/v1/questions", agent, body, headers={"Idempotency-Key": "enc-2"})
    assert (packed_first.status, as_json.status) == (201, 200)
    assert packed_first.headers["Content-Type"].startswith("application/msgpack")
    assert as_json.body == packed_first.body
    assert as_json.body["id"] != first.body["id"]


async def test_replay_after_the_question_was_answered_returns_it_as_it_stands(api: Api) -> None:
    agent, _ = await people(api)
    alice_token = await api.call("POST", "/v1/admin/principals/alice/tokens", ADMIN_TOKEN)
    body = ask_body({"user": "alice"})
    first = await api.call("POST", "/v1/questions", agent, body, headers={"Idempotency-Key": "late"})
    answered = await api.answer(alice_token.body["token"], first.body["id"], "yes")
    assert answered.body["applied"] is True

    replay = await api.call("POST", "/v1/questions", agent, body, headers={"Idempotency-Key": "late"})

    assert replay.status == 200
    assert replay.body == answered.body["question"]


# -- answers and cancels: a retry after a lost reply is told what its first try did -------------


async def test_an_answer_sent_again_with_its_idempotency_key_is_told_applied_and_changes_nothing(
    api: Api, settings: Settings, redis: Redis
) -> None:
    agent, _ = await people(api)
    alice = (await api.call("POST", "/v1/admin/principals/alice/tokens", ADMIN_TOKEN)).body["token"]
    question = (await api.call("POST", "/v1/questions", agent, ask_body({"user": "alice"}))).body
    path = f"/v1/questions/{question['id']}/answer"
    key = {"Idempotency-Key": "tap-1"}

    first = await api.call("POST", path, alice, {"option": "yes"}, headers=key)
    retried = await api.call("POST", path, alice, {"option": "yes"}, headers=key)
    unkeyed = await api.call("POST", path, alice, {"option": "yes"})
    other_option = await api.call("POST", path, alice, {"option": "no"}, headers=key)

    assert [r.body["applied"] for r in (first, retried, unkeyed, other_option)] == [True, True, False, False]
    assert retried.body["question"] == first.body["question"] == other_option.body["question"]
    assert first.body["question"]["version"] == 2
    totals = await stats_totals(redis, settings.key_prefix)
    assert (totals["answered"], totals["stale"]) == (1, 2)  # the keyed retry is not a stale tap


async def test_the_same_answer_key_from_another_room_member_is_not_told_applied(api: Api) -> None:
    agent, _ = await people(api)
    tokens = {}
    for user in ("bob", "carol"):
        await api.principal(user, "user")
        tokens[user] = (await api.call("POST", f"/v1/admin/principals/{user}/tokens", ADMIN_TOKEN)).body[
            "token"
        ]
    await api.room("ops", ["bob", "carol"])
    question = (await api.call("POST", "/v1/questions", agent, ask_body({"room": "ops"}))).body
    path = f"/v1/questions/{question['id']}/answer"
    key = {"Idempotency-Key": "same-key"}

    bob = await api.call("POST", path, tokens["bob"], {"option": "yes"}, headers=key)
    carol = await api.call("POST", path, tokens["carol"], {"option": "yes"}, headers=key)

    assert (bob.body["applied"], carol.body["applied"]) == (True, False)
    assert carol.body["question"]["answer"]["responder"] == "bob"


async def test_an_answer_resent_with_its_key_after_the_responder_left_the_room_is_told_applied(
    api: Api,
) -> None:
    agent, _ = await people(api)
    await api.principal("bob", "user")
    bob = (await api.call("POST", "/v1/admin/principals/bob/tokens", ADMIN_TOKEN)).body["token"]
    await api.room("ops", ["bob"])
    question = (await api.call("POST", "/v1/questions", agent, ask_body({"room": "ops"}))).body
    path = f"/v1/questions/{question['id']}/answer"
    key = {"Idempotency-Key": "tap-1"}
    first = await api.call("POST", path, bob, {"option": "yes"}, headers=key)
    await api.room("ops", [])

    retried = await api.call("POST", path, bob, {"option": "yes"}, headers=key)
    assert retried.status == 200, retried.body
    assert retried.body == first.body == {"applied": True, "question": first.body["question"]}
    unkeyed = await api.call("POST", path, bob, {"option": "yes"})
    assert unkeyed.status == 404  # a new request from outside the room still sees nothing


async def test_a_cancel_sent_again_with_its_idempotency_key_is_told_applied(api: Api) -> None:
    agent, _ = await people(api)
    question = (await api.call("POST", "/v1/questions", agent, ask_body({"user": "alice"}))).body
    path = f"/v1/questions/{question['id']}/cancel"
    key = {"Idempotency-Key": "withdraw-1"}

    first = await api.call("POST", path, agent, {"reason": "plan changed"}, headers=key)
    retried = await api.call("POST", path, agent, {"reason": "plan changed"}, headers=key)
    other_reason = await api.call("POST", path, agent, {"reason": "another"}, headers=key)

    assert [r.body["applied"] for r in (first, retried, other_reason)] == [True, True, False]
    assert retried.body["question"] == first.body["question"]
    assert first.body["question"]["cancellation"] == {"by": "deploybot", "reason": "plan changed"}


async def test_a_bad_idempotency_key_on_an_answer_is_422_and_answers_nothing(api: Api) -> None:
    agent, _ = await people(api)
    alice = (await api.call("POST", "/v1/admin/principals/alice/tokens", ADMIN_TOKEN)).body["token"]
    question = (await api.call("POST", "/v1/questions", agent, ask_body({"user": "alice"}))).body
    path = f"/v1/questions/{question['id']}/answer"

    refused = await api.call("POST", path, alice, {"option": "yes"}, headers={"Idempotency-Key": "x" * 256})

    assert refused.status == 422
    assert (await api.call("GET", f"/v1/questions/{question['id']}", agent)).body["state"] == "pending"
