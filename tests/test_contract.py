"""The HTTP contract of issue 2, one test per transition and per refusal, through HTTP only.

Every test runs on a real Redis and on the in-memory fakeredis backend (`any_api`), except the
few that need their own settings. Paths, field names and status codes are the contract.
"""

from __future__ import annotations

import asyncio
import base64
from datetime import timedelta, timezone
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from service import auth as auth_module
from service.http.appkeys import DIRECTORY, WAITERS
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_contract import (
    Cast,
    Unchanged,
    assert_envelope,
    assert_problem,
    make_cast,
    now_utc,
    parse_ts,
    question_body,
    redis_of,
    send,
    settings_of,
    snapshot,
    within,
)
from tests.redis_server import RedisServer


@pytest.fixture
async def cast(any_api: Api) -> Cast:
    return await make_cast(any_api)


async def ask(cast: Cast, to: dict[str, str] | None = None, **changes: Any) -> dict[str, Any]:
    reply = await send(
        cast.api.client,
        "POST",
        "/v1/questions",
        cast.agent,
        body=question_body(to or {"user": "alice"}, **changes),
    )
    assert reply.status == 201, reply.data
    envelope: dict[str, Any] = reply.body
    return envelope


async def answer(cast: Cast, token: str, question_id: str, option: str = "yes") -> dict[str, Any]:
    reply = await cast.api.answer(token, question_id, option)
    assert reply.status == 200, reply.body
    assert set(reply.body) >= {"applied", "question"}
    assert_envelope(reply.body["question"])
    result: dict[str, Any] = reply.body
    return result


async def cancel(cast: Cast, token: str, question_id: str, reason: str | None = None) -> dict[str, Any]:
    reply = await cast.api.cancel(token, question_id, reason)
    assert reply.status == 200, reply.body
    assert_envelope(reply.body["question"])
    result: dict[str, Any] = reply.body
    return result


async def fetch(cast: Cast, question_id: str, token: str | None = None) -> dict[str, Any]:
    reply = await cast.api.get(token or cast.agent, question_id)
    assert reply.status == 200, reply.body
    assert_envelope(reply.body)
    result: dict[str, Any] = reply.body
    return result


async def listing(cast: Cast, token: str, query: str = "") -> dict[str, Any]:
    reply = await send(cast.api.client, "GET", f"/v1/questions{query}", token)
    assert reply.status == 200, reply.data
    assert set(reply.body) == {"items", "next_cursor"}
    for item in reply.body["items"]:
        assert_envelope(item)
    result: dict[str, Any] = reply.body
    return result


def ids(page: dict[str, Any]) -> list[str]:
    return [item["id"] for item in page["items"]]


async def past_deadline(envelope: dict[str, Any]) -> None:
    """Sleep until just after the question's deadline (host clock and Redis TIME are one here)."""
    remaining = (parse_ts(envelope["expires_at"]) - now_utc()).total_seconds()
    await asyncio.sleep(max(0.0, remaining) + 0.05)


async def parked_waiters(api: Api, count: int) -> None:
    """Until `count` long polls are parked on their channels (no fixed sleep)."""
    waiters = api.client.app[WAITERS]
    while waiters.waiting < count:  # noqa: ASYNC110 - the service exposes a count, not an event
        await asyncio.sleep(0.01)


# -- create -------------------------------------------------------------------------------------


async def test_create_returns_201_with_location_and_a_complete_pending_envelope(cast: Cast) -> None:
    before = now_utc()
    body = question_body({"user": "alice"}, expires_in=600)
    reply = await send(cast.api.client, "POST", "/v1/questions", cast.agent, body=body)

    assert reply.status == 201, reply.data
    assert reply.content_type == "application/json"
    envelope = reply.body
    assert_envelope(envelope)
    assert reply.headers["Location"] == f"/v1/questions/{envelope['id']}"
    assert envelope["state"] == "pending"
    assert envelope["prompt"] == body["prompt"]
    assert envelope["options"] == body["options"]
    assert envelope["to"] == {"user": "alice"}
    assert envelope["asker"] == "deploybot"
    assert envelope["resolved_at"] is None
    assert envelope["answer"] is None
    assert envelope["cancellation"] is None
    assert envelope["metadata"] in ({}, None)
    assert envelope["version"] == 1
    created, expires = parse_ts(envelope["created_at"]), parse_ts(envelope["expires_at"])
    assert expires - created == timedelta(seconds=600)
    assert abs((created - before).total_seconds()) < 60  # Redis TIME, the same machine's clock

    located = await send(cast.api.client, "GET", reply.headers["Location"], cast.agent)
    assert located.status == 200
    assert located.body == envelope


async def test_create_for_a_room_targets_the_room(cast: Cast) -> None:
    envelope = await ask(cast, {"room": "ops"})
    assert envelope["to"] == {"room": "ops"}
    assert envelope["state"] == "pending"


async def test_create_with_expires_at_keeps_that_deadline_to_the_millisecond(cast: Cast) -> None:
    deadline = (now_utc() + timedelta(hours=2)).replace(microsecond=456_000)
    zulu = deadline.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    envelope = await ask(cast, expires_in=..., expires_at=zulu)
    assert envelope["expires_at"] == deadline.strftime("%Y-%m-%dT%H:%M:%S.456Z")


async def test_create_with_expires_at_in_lowercase_t_and_z_is_accepted_as_rfc3339_allows(cast: Cast) -> None:
    deadline = (now_utc() + timedelta(hours=2)).replace(microsecond=250_000)
    lower = deadline.strftime("%Y-%m-%dt%H:%M:%S.250z")
    envelope = await ask(cast, expires_in=..., expires_at=lower)
    assert envelope["expires_at"] == deadline.strftime("%Y-%m-%dT%H:%M:%S.250Z")


async def test_create_with_expires_at_in_another_timezone_is_normalised_to_utc(cast: Cast) -> None:
    deadline = (now_utc() + timedelta(days=1)).replace(microsecond=7_000)
    shifted = deadline.astimezone(timezone(timedelta(hours=-5, minutes=-30)))
    envelope = await ask(cast, expires_in=..., expires_at=shifted.isoformat(timespec="milliseconds"))
    assert envelope["expires_at"] == deadline.strftime("%Y-%m-%dT%H:%M:%S.007Z")


async def test_metadata_round_trips_unchanged(cast: Cast) -> None:
    metadata = {
        "build": 42,
        "ratio": 0.25,
        "ok": True,
        "none": None,
        "tags": ["a", "ü", "🚀"],
        "nested": {"deep": {"er": [1, {"x": "y"}]}},
        "quote": 'he said "hi" \\ /',
    }
    envelope = await ask(cast, metadata=metadata)
    assert envelope["metadata"] == metadata
    assert (await fetch(cast, envelope["id"]))["metadata"] == metadata


@pytest.mark.parametrize(
    "to",
    [{"user": "nobody"}, {"room": "nowhere"}, {"user": "otherbot"}, {"room": "alice"}],
    ids=["missing-user", "missing-room", "agent-as-user", "user-as-room"],
)
async def test_create_for_a_target_that_does_not_exist_is_422(cast: Cast, to: dict[str, str]) -> None:
    async with Unchanged(cast.api):
        reply = await send(cast.api.client, "POST", "/v1/questions", cast.agent, body=question_body(to))
    assert_problem(reply, 422)


async def test_idempotency_key_replay_returns_the_original_question_with_200(cast: Cast) -> None:
    body = question_body({"user": "alice"})
    headers = {"Idempotency-Key": "deploy-42"}
    first = await send(cast.api.client, "POST", "/v1/questions", cast.agent, body=body, headers=headers)
    again = await send(cast.api.client, "POST", "/v1/questions", cast.agent, body=body, headers=headers)
    assert first.status == 201
    assert again.status == 200
    assert again.body == first.body
    assert again.headers["Location"] == first.headers["Location"]
    assert ids(await listing(cast, cast.agent)) == [first.body["id"]]


async def test_idempotency_key_with_a_different_body_is_422(cast: Cast) -> None:
    headers = {"Idempotency-Key": "deploy-42"}
    first = await send(
        cast.api.client,
        "POST",
        "/v1/questions",
        cast.agent,
        body=question_body({"user": "alice"}),
        headers=headers,
    )
    assert first.status == 201
    changed = question_body({"user": "alice"}, prompt="Something else?")
    async with Unchanged(cast.api):
        reply = await send(
            cast.api.client, "POST", "/v1/questions", cast.agent, body=changed, headers=headers
        )
    assert_problem(reply, 422)


async def test_the_same_idempotency_key_from_another_agent_creates_its_own_question(cast: Cast) -> None:
    body = question_body({"user": "alice"})
    headers = {"Idempotency-Key": "shared-key"}
    mine = await send(cast.api.client, "POST", "/v1/questions", cast.agent, body=body, headers=headers)
    theirs = await send(
        cast.api.client, "POST", "/v1/questions", cast.other_agent, body=body, headers=headers
    )
    assert (mine.status, theirs.status) == (201, 201)
    assert mine.body["id"] != theirs.body["id"]
    assert theirs.body["asker"] == "otherbot"


# -- fetch --------------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["asker", "target", "admin"])
async def test_fetch_returns_the_envelope_to_whoever_may_see_it(cast: Cast, who: str) -> None:
    created = await ask(cast)
    token = {"asker": cast.agent, "target": cast.alice, "admin": cast.admin}[who]
    assert await fetch(cast, created["id"], token) == created


async def test_room_members_may_fetch_a_room_question(cast: Cast) -> None:
    created = await ask(cast, {"room": "ops"})
    assert await fetch(cast, created["id"], cast.bob) == created
    assert await fetch(cast, created["id"], cast.carol) == created


async def test_fetch_by_someone_who_may_not_see_it_is_404_like_an_unknown_id(cast: Cast) -> None:
    created = await ask(cast)
    hidden = await cast.api.get(cast.dave, created["id"])
    unknown = await cast.api.get(cast.dave, "0" * 25)
    assert hidden.status == unknown.status == 404
    assert hidden.headers["Content-Type"].startswith("application/problem+json")


async def test_fetch_after_the_deadline_shows_the_question_expired(cast: Cast) -> None:
    created = await ask(cast, expires_in=1)
    await past_deadline(created)
    envelope = await fetch(cast, created["id"])
    assert envelope["state"] == "expired"
    assert envelope["answer"] is None
    assert parse_ts(envelope["resolved_at"]) >= parse_ts(envelope["expires_at"])


# -- list ---------------------------------------------------------------------------------------


async def test_list_with_a_state_filter_returns_only_questions_in_that_state(cast: Cast) -> None:
    pending = await ask(cast)
    answered = await ask(cast)
    cancelled = await ask(cast)
    await answer(cast, cast.alice, answered["id"])
    await cancel(cast, cast.agent, cancelled["id"])

    assert ids(await listing(cast, cast.agent, "?state=pending")) == [pending["id"]]
    assert ids(await listing(cast, cast.agent, "?state=answered")) == [answered["id"]]
    assert ids(await listing(cast, cast.agent, "?state=cancelled")) == [cancelled["id"]]
    assert ids(await listing(cast, cast.agent, "?state=expired")) == []
    everything = set(ids(await listing(cast, cast.agent)))
    assert everything == {pending["id"], answered["id"], cancelled["id"]}


async def test_role_asker_lists_the_agents_own_questions_only(cast: Cast) -> None:
    mine = await ask(cast)
    theirs = await send(
        cast.api.client, "POST", "/v1/questions", cast.other_agent, body=question_body({"user": "alice"})
    )
    assert theirs.status == 201
    page = await listing(cast, cast.agent, "?role=asker")
    assert ids(page) == [mine["id"]]
    assert page["items"][0] == mine
    assert ids(await listing(cast, cast.other_agent, "?role=asker")) == [theirs.body["id"]]


async def test_role_responder_lists_direct_questions_and_those_to_the_users_rooms(cast: Cast) -> None:
    to_alice = await ask(cast, {"user": "alice"})
    to_bob = await ask(cast, {"user": "bob"})
    to_ops = await ask(cast, {"room": "ops"})

    assert set(ids(await listing(cast, cast.bob, "?role=responder"))) == {to_bob["id"], to_ops["id"]}
    assert ids(await listing(cast, cast.carol, "?role=responder")) == [to_ops["id"]]
    assert ids(await listing(cast, cast.alice, "?role=responder")) == [to_alice["id"]]
    assert ids(await listing(cast, cast.dave, "?role=responder")) == []
    # A user's default role is responder.
    assert set(ids(await listing(cast, cast.bob))) == {to_bob["id"], to_ops["id"]}


async def test_a_user_removed_from_a_room_no_longer_lists_sees_or_answers_its_questions(cast: Cast) -> None:
    to_ops = await ask(cast, {"room": "ops"})
    removed = await send(cast.api.client, "DELETE", "/v1/admin/rooms/ops/members/carol", cast.admin)
    assert removed.status == 204
    assert ids(await listing(cast, cast.carol, "?role=responder")) == []
    assert (await cast.api.get(cast.carol, to_ops["id"])).status == 404
    async with Unchanged(cast.api):
        refused = await cast.api.answer(cast.carol, to_ops["id"], "yes")
    assert refused.status == 404


async def test_room_filter_keeps_only_that_rooms_questions(cast: Cast) -> None:
    await cast.api.room("infra", ["bob"])
    to_ops = await ask(cast, {"room": "ops"})
    to_infra = await ask(cast, {"room": "infra"})
    await ask(cast, {"user": "bob"})

    assert ids(await listing(cast, cast.agent, "?room=ops")) == [to_ops["id"]]
    assert ids(await listing(cast, cast.bob, "?room=infra")) == [to_infra["id"]]
    assert ids(await listing(cast, cast.bob, "?role=responder&room=ops")) == [to_ops["id"]]


async def test_admin_lists_one_named_room(cast: Cast) -> None:
    to_ops = await ask(cast, {"room": "ops"})
    await ask(cast, {"user": "alice"})
    assert ids(await listing(cast, cast.admin, "?room=ops")) == [to_ops["id"]]
    unnamed = await send(cast.api.client, "GET", "/v1/questions", cast.admin)
    assert_problem(unnamed, 422)


async def test_limit_caps_the_page_and_gives_a_cursor(cast: Cast) -> None:
    for _ in range(3):
        await ask(cast)
    page = await listing(cast, cast.agent, "?limit=2")
    assert len(page["items"]) == 2
    assert isinstance(page["next_cursor"], str)
    assert page["next_cursor"]


async def test_list_returns_50_items_by_default(cast: Cast) -> None:
    for _ in range(51):
        await ask(cast)
    page = await listing(cast, cast.agent)
    assert len(page["items"]) == 50
    assert page["next_cursor"] is not None
    rest = await listing(cast, cast.agent, f"?cursor={page['next_cursor']}")
    assert len(rest["items"]) == 1
    assert rest["next_cursor"] is None


def newest_first(items: list[dict[str, Any]]) -> bool:
    keys = [(item["created_at"], item["id"]) for item in items]
    return keys == sorted(keys, reverse=True)


async def test_pages_run_newest_first_without_gaps_or_repeats_while_questions_arrive(cast: Cast) -> None:
    original = [(await ask(cast))["id"] for _ in range(7)]
    first = await listing(cast, cast.agent, "?limit=3")
    assert newest_first(first["items"])
    # Every original question is older than or as old as the next one created.
    assert set(ids(first)) <= set(original)

    arrived = [(await ask(cast))["id"] for _ in range(2)]  # inserted between pages
    second = await listing(cast, cast.agent, f"?limit=3&cursor={first['next_cursor']}")
    arrived.append((await ask(cast))["id"])
    third = await listing(cast, cast.agent, f"?limit=3&cursor={second['next_cursor']}")

    walked = ids(first) + ids(second) + ids(third)
    assert sorted(walked) == sorted(original), "every original question exactly once"
    assert not set(walked) & set(arrived), "questions created after page one sort above its cursor"
    assert newest_first(first["items"] + second["items"] + third["items"])
    assert [len(first["items"]), len(second["items"]), len(third["items"])] == [3, 3, 1]
    assert third["next_cursor"] is None
    fresh = await listing(cast, cast.agent, "?limit=3")
    assert set(ids(fresh)) == set(arrived), "the newest page holds the questions that arrived"


async def test_next_cursor_is_null_on_a_last_page_that_is_exactly_full(cast: Cast) -> None:
    created = [(await ask(cast))["id"] for _ in range(4)]
    first = await listing(cast, cast.agent, "?limit=2")
    last = await listing(cast, cast.agent, f"?limit=2&cursor={first['next_cursor']}")
    assert sorted(ids(first) + ids(last)) == sorted(created)
    assert last["next_cursor"] is None


async def test_next_cursor_is_null_when_everything_fits(cast: Cast) -> None:
    await ask(cast)
    assert (await listing(cast, cast.agent))["next_cursor"] is None
    assert await listing(cast, cast.dave) == {"items": [], "next_cursor": None}


@pytest.mark.parametrize(
    "cursor",
    ["garbage!!", base64.urlsafe_b64encode(b"hello").decode(), "MTIz", "%FF%FE", "0" * 200],
    ids=["not-base64", "base64-of-junk", "base64-of-digits", "bad-utf8", "long"],
)
async def test_a_cursor_the_service_did_not_issue_is_422(cast: Cast, cursor: str) -> None:
    await ask(cast)
    reply = await send(cast.api.client, "GET", f"/v1/questions?cursor={cursor}", cast.agent)
    assert_problem(reply, 422)


# -- answer -------------------------------------------------------------------------------------


async def test_first_answer_is_applied_and_records_option_responder_and_time(cast: Cast) -> None:
    created = await ask(cast)
    reply = await answer(cast, cast.alice, created["id"], "no")
    assert reply["applied"] is True
    envelope = reply["question"]
    assert envelope["state"] == "answered"
    assert envelope["answer"]["option"] == "no"
    assert envelope["answer"]["responder"] == "alice"
    assert envelope["resolved_at"] == envelope["answer"]["answered_at"]
    assert parse_ts(created["created_at"]) <= parse_ts(envelope["answer"]["answered_at"])
    assert envelope["version"] > created["version"]
    unchanged = {k: v for k, v in created.items() if k not in ("state", "resolved_at", "answer", "version")}
    assert {k: envelope[k] for k in unchanged} == unchanged
    assert await fetch(cast, created["id"]) == envelope


async def test_second_tap_returns_the_first_answer_unapplied(cast: Cast) -> None:
    created = await ask(cast)
    first = await answer(cast, cast.alice, created["id"], "yes")
    again = await answer(cast, cast.alice, created["id"], "yes")
    changed_mind = await answer(cast, cast.alice, created["id"], "no")
    assert first["applied"] is True
    assert again == {"applied": False, "question": first["question"]}
    assert changed_mind == {"applied": False, "question": first["question"]}


async def test_another_members_later_tap_returns_the_first_answer_unapplied(cast: Cast) -> None:
    created = await ask(cast, {"room": "ops"})
    first = await answer(cast, cast.bob, created["id"], "yes")
    later = await answer(cast, cast.carol, created["id"], "no")
    assert first["applied"] is True
    assert first["question"]["answer"]["responder"] == "bob"
    assert later == {"applied": False, "question": first["question"]}


async def test_room_membership_is_read_when_someone_answers_not_when_the_question_was_asked(
    cast: Cast,
) -> None:
    """A room with no members takes questions; a member added later may answer, and a member
    removed after the question was asked no longer may (404, nothing changes)."""
    client, admin = cast.api.client, cast.admin
    emptied = await send(client, "PUT", "/v1/admin/rooms/later", admin, body={"members": []})
    assert emptied.status == 200, emptied.data
    first = await ask(cast, {"room": "later"})
    second = await ask(cast, {"room": "ops"})
    assert (await cast.api.answer(cast.dave, first["id"], "yes")).status == 404

    joined = await send(client, "PUT", "/v1/admin/rooms/later/members/dave", admin)
    assert joined.status == 200, joined.data
    answered = await answer(cast, cast.dave, first["id"])
    assert answered["applied"] is True
    assert answered["question"]["answer"]["responder"] == "dave"

    left = await send(client, "DELETE", "/v1/admin/rooms/ops/members/bob", admin)
    assert left.status == 204
    async with Unchanged(cast.api):
        assert (await cast.api.answer(cast.bob, second["id"], "yes")).status == 404
    assert (await answer(cast, cast.carol, second["id"]))["applied"] is True


async def test_an_unknown_option_is_422_and_changes_nothing(cast: Cast) -> None:
    created = await ask(cast)
    async with Unchanged(cast.api):
        reply = await send(
            cast.api.client,
            "POST",
            f"/v1/questions/{created['id']}/answer",
            cast.alice,
            body={"option": "maybe"},
        )
    assert_problem(reply, 422)
    assert (await fetch(cast, created["id"]))["state"] == "pending"


@pytest.mark.parametrize("field", ["responder", "responder_id", "user", "user_id", "by", "answered_by"])
async def test_a_responder_identity_in_the_body_is_400(cast: Cast, field: str) -> None:
    created = await ask(cast)
    async with Unchanged(cast.api):
        reply = await send(
            cast.api.client,
            "POST",
            f"/v1/questions/{created['id']}/answer",
            cast.alice,
            body={"option": "yes", field: "alice"},
        )
    assert_problem(reply, 400)


async def test_a_responder_identity_in_the_query_is_400(cast: Cast) -> None:
    created = await ask(cast)
    async with Unchanged(cast.api):
        reply = await send(
            cast.api.client,
            "POST",
            f"/v1/questions/{created['id']}/answer?responder=alice",
            cast.alice,
            body={"option": "yes"},
        )
    assert_problem(reply, 400)


async def test_answer_after_cancel_returns_the_cancelled_question_unapplied(cast: Cast) -> None:
    created = await ask(cast)
    cancelled = await cancel(cast, cast.agent, created["id"], "not needed")
    late = await answer(cast, cast.alice, created["id"], "yes")
    assert late == {"applied": False, "question": cancelled["question"]}
    assert late["question"]["state"] == "cancelled"
    assert late["question"]["answer"] is None


async def test_answer_after_the_deadline_never_answers_and_says_expired(cast: Cast) -> None:
    created = await ask(cast, {"room": "ops"}, expires_in=1)
    await past_deadline(created)
    late = await answer(cast, cast.bob, created["id"], "yes")
    assert late["applied"] is False
    assert late["question"]["state"] == "expired"
    assert late["question"]["answer"] is None
    assert await fetch(cast, created["id"]) == late["question"]


# -- cancel -------------------------------------------------------------------------------------


async def test_asker_cancels_and_the_reason_is_recorded(cast: Cast) -> None:
    created = await ask(cast)
    reply = await cancel(cast, cast.agent, created["id"], "deploy was rolled back")
    assert reply["applied"] is True
    envelope = reply["question"]
    assert envelope["state"] == "cancelled"
    assert envelope["cancellation"] == {"by": "deploybot", "reason": "deploy was rolled back"}
    assert envelope["answer"] is None
    assert envelope["resolved_at"] is not None
    assert await fetch(cast, created["id"]) == envelope


async def test_a_reason_of_exactly_500_characters_is_kept_whole(cast: Cast) -> None:
    created = await ask(cast)
    reason = "r" * 499 + "é"
    reply = await cancel(cast, cast.agent, created["id"], reason)
    assert reply["question"]["cancellation"]["reason"] == reason


async def test_cancel_without_a_body_records_no_reason(cast: Cast) -> None:
    created = await ask(cast)
    reply = await cancel(cast, cast.agent, created["id"])
    assert reply["applied"] is True
    assert reply["question"]["cancellation"]["by"] == "deploybot"
    assert reply["question"]["cancellation"]["reason"] in (None, "")


async def test_an_admin_may_cancel_any_question_and_is_recorded_as_the_canceller(cast: Cast) -> None:
    created = await ask(cast, {"room": "ops"})
    reply = await cancel(cast, cast.admin, created["id"], "room is being retired")
    assert reply["applied"] is True
    assert reply["question"]["state"] == "cancelled"
    assert reply["question"]["cancellation"] == {"by": "admin", "reason": "room is being retired"}


async def test_a_stale_cancel_after_an_answer_returns_the_answer_unapplied(cast: Cast) -> None:
    created = await ask(cast)
    answered = await answer(cast, cast.alice, created["id"], "yes")
    stale = await cancel(cast, cast.agent, created["id"], "too late")
    assert stale == {"applied": False, "question": answered["question"]}


async def test_a_second_cancel_is_unapplied_and_keeps_the_first_reason(cast: Cast) -> None:
    created = await ask(cast)
    first = await cancel(cast, cast.agent, created["id"], "first")
    second = await cancel(cast, cast.admin, created["id"], "second")
    assert second == {"applied": False, "question": first["question"]}
    assert second["question"]["cancellation"]["reason"] == "first"


# -- wait ---------------------------------------------------------------------------------------


async def test_wait_on_a_terminal_question_returns_it_at_once(cast: Cast) -> None:
    created = await ask(cast)
    answered = await answer(cast, cast.alice, created["id"])
    waited = await within(5, cast.api.wait(cast.agent, created["id"], 10), "wait on an answered question")
    assert waited.status == 200
    assert waited.body == answered["question"]


@pytest.mark.parametrize("how", ["answer", "cancel"])
async def test_wait_wakes_when_the_question_is_resolved(cast: Cast, how: str) -> None:
    created = await ask(cast)
    waiting = asyncio.create_task(cast.api.wait(cast.agent, created["id"], 10))
    await within(5, parked_waiters(cast.api, 1), "the long poll parking")
    assert not waiting.done()
    if how == "answer":
        resolved = await answer(cast, cast.alice, created["id"])
    else:
        resolved = await cancel(cast, cast.agent, created["id"], "changed plan")
    waited = await within(5, waiting, "the woken long poll")
    assert waited.status == 200
    assert waited.body == resolved["question"]


async def test_wait_wakes_when_the_deadline_passes(cast: Cast) -> None:
    created = await ask(cast, expires_in=1)
    # Bounded well inside the wait's own 10 s: at its timeout a wait reads the question again,
    # which would expire it too, so only the bound shows that the expiry itself woke it.
    waited = await within(4, cast.api.wait(cast.agent, created["id"], 10), "wait across the deadline")
    assert waited.status == 200
    assert waited.body["state"] == "expired"
    assert waited.body == await fetch(cast, created["id"])


async def test_wait_returns_the_pending_envelope_after_its_timeout(cast: Cast) -> None:
    created = await ask(cast)
    waited = await cast.api.wait(cast.agent, created["id"], 0.2)
    assert waited.status == 200
    assert waited.body == created


async def test_wait_accepts_prefer_wait(cast: Cast) -> None:
    created = await ask(cast)
    # Without the preference the default (5 s in tests) would apply: the guard tells them apart.
    waited = await within(
        3,
        send(
            cast.api.client,
            "GET",
            f"/v1/questions/{created['id']}/wait",
            cast.agent,
            headers={"Prefer": "wait=0.2"},
        ),
        "a wait with Prefer: wait=0.2",
    )
    assert waited.status == 200
    assert waited.body == created
    assert waited.headers["Preference-Applied"] == "wait=0.2"


async def test_wait_timeout_is_clamped_to_the_configured_maximum(redis_server: RedisServer) -> None:
    client = await start_client(
        settings_for(redis_server.url, wait_max_seconds=0.3, wait_default_seconds=0.3)
    )
    try:
        cast = await make_cast(Api(client, ADMIN_TOKEN))
        created = await ask(cast)
        by_query = await within(
            5, cast.api.wait(cast.agent, created["id"], 60), "a wait?timeout=60 clamped to 0.3 s"
        )
        by_prefer = await within(
            5,
            send(
                client,
                "GET",
                f"/v1/questions/{created['id']}/wait",
                cast.agent,
                headers={"Prefer": "wait=60"},
            ),
            "a Prefer: wait=60 clamped to 0.3 s",
        )
        assert by_query.status == by_prefer.status == 200
        assert by_query.body == by_prefer.body == created
        assert by_prefer.headers["Preference-Applied"] == "wait=0.3"
        assert "Preference-Applied" not in by_query.headers
        # More digits than a float holds is still a number of seconds, only a long one.
        by_long_prefer = await within(
            5,
            send(
                client,
                "GET",
                f"/v1/questions/{created['id']}/wait",
                cast.agent,
                headers={"Prefer": "wait=" + "9" * 400},
            ),
            "a Prefer: wait=<400 digits> clamped to 0.3 s",
        )
        assert by_long_prefer.status == 200
        assert by_long_prefer.headers["Preference-Applied"] == "wait=0.3"
    finally:
        await client.close()


@pytest.mark.parametrize("prefer", ["wait=abc", "wait=-1", "wait=1e9", "nowait=5", "return=minimal"])
async def test_wait_ignores_a_prefer_header_without_a_usable_wait_and_says_nothing_applied(
    redis_server: RedisServer, prefer: str
) -> None:
    """RFC 7240: a preference the server cannot comply with is ignored, not an error, and
    Preference-Applied names only what was applied. The default wait applies."""
    settings = settings_for(redis_server.url, wait_max_seconds=0.3, wait_default_seconds=0.3)
    client = await start_client(settings)
    try:
        cast = await make_cast(Api(client, ADMIN_TOKEN))
        created = await ask(cast)
        path = f"/v1/questions/{created['id']}/wait"
        waited = await within(5, send(client, "GET", path, cast.agent, headers={"Prefer": prefer}), prefer)
        assert waited.status == 200
        assert waited.body == created
        assert "Preference-Applied" not in waited.headers
    finally:
        await client.close()


# -- one terminal envelope from every path ------------------------------------------------------


async def resolve(cast: Cast, story: str, question_id: str) -> dict[str, Any]:
    if story == "answered":
        return (await answer(cast, cast.bob, question_id, "yes"))["question"]
    if story == "cancelled":
        return (await cancel(cast, cast.agent, question_id, "no longer needed"))["question"]
    envelope = await fetch(cast, question_id)
    await past_deadline(envelope)
    return await fetch(cast, question_id)


@pytest.mark.parametrize("story", ["answered", "cancelled", "expired"])
async def test_every_path_returns_the_same_terminal_envelope(cast: Cast, story: str) -> None:
    created = await ask(cast, {"room": "ops"}, expires_in=1 if story == "expired" else 600)
    final = await resolve(cast, story, created["id"])
    assert final["state"] == story
    path = f"/v1/questions/{created['id']}"

    fetched = await send(cast.api.client, "GET", path, cast.agent)
    waited = await send(cast.api.client, "GET", f"{path}/wait?timeout=5", cast.agent)
    assert fetched.data == waited.data, "fetch and wait differ byte for byte"
    assert fetched.body == final

    listed = await listing(cast, cast.agent)
    assert [item for item in listed["items"] if item["id"] == created["id"]] == [final]
    as_member = await listing(cast, cast.carol, "?role=responder")
    assert [item for item in as_member["items"] if item["id"] == created["id"]] == [final]

    stale_answer = await answer(cast, cast.carol, created["id"], "no")
    stale_cancel = await cancel(cast, cast.agent, created["id"], "again")
    assert stale_answer == stale_cancel == {"applied": False, "question": final}
    assert (await send(cast.api.client, "GET", path, cast.bob)).data == fetched.data


async def test_a_woken_wait_returns_byte_for_byte_the_fetched_envelope(cast: Cast) -> None:
    created = await ask(
        cast,
        {"room": "ops"},
        prompt='Ship “Ünïcode” 🚀 \\ "quoted" / \u2028 line\nbreak?',
        options=[{"id": "go", "label": "Go 🚀"}, {"id": "stop", "label": "Stop ✋"}],
        metadata={"emoji": "🚀", "slash": "a/b", "nested": {"n": [1, 2.5, None, True]}, "empty": {}},
    )
    path = f"/v1/questions/{created['id']}"
    waiting = asyncio.create_task(send(cast.api.client, "GET", f"{path}/wait?timeout=10", cast.agent))
    await within(5, parked_waiters(cast.api, 1), "the long poll parking")
    reply = await send(cast.api.client, "POST", f"{path}/answer", cast.carol, body={"option": "go"})
    assert reply.status == 200
    waited = await within(5, waiting, "the woken long poll")
    fetched = await send(cast.api.client, "GET", path, cast.agent)
    assert waited.body["state"] == "answered"
    assert waited.data == fetched.data, "the woken wait and fetch differ byte for byte"
    assert reply.body["question"] == fetched.body


# -- msgpack ------------------------------------------------------------------------------------


async def test_msgpack_requests_and_responses_carry_the_same_content_as_json(cast: Cast) -> None:
    client = cast.api.client
    body = question_body({"room": "ops"}, metadata={"n": 1, "f": 0.5, "s": "ü", "l": [None, True]})
    created = await send(
        client,
        "POST",
        "/v1/questions",
        cast.agent,
        body=body,
        msgpack_body=True,
        accept="application/msgpack",
    )
    assert created.status == 201
    assert created.content_type == "application/msgpack"
    assert created.headers["Location"] == f"/v1/questions/{created.body['id']}"
    path = f"/v1/questions/{created.body['id']}"

    as_json = await send(client, "GET", path, cast.agent)
    as_msgpack = await send(client, "GET", path, cast.agent, accept="application/msgpack")
    assert as_json.content_type == "application/json"
    assert as_msgpack.content_type == "application/msgpack"
    assert as_msgpack.body == as_json.body == created.body
    assert created.body["metadata"] == body["metadata"]

    answered = await send(
        client,
        "POST",
        f"{path}/answer",
        cast.bob,
        body={"option": "yes"},
        msgpack_body=True,
        accept="application/msgpack",
    )
    assert answered.status == 200
    assert answered.content_type == "application/msgpack"
    assert answered.body["applied"] is True
    assert answered.body["question"] == (await send(client, "GET", path, cast.agent)).body

    listed_json = await send(client, "GET", "/v1/questions", cast.agent)
    listed_msgpack = await send(client, "GET", "/v1/questions", cast.agent, accept="application/msgpack")
    assert listed_msgpack.body == listed_json.body
    waited = await send(client, "GET", f"{path}/wait?timeout=1", cast.agent, accept="application/msgpack")
    assert waited.body == answered.body["question"]


async def test_a_msgpack_cancel_body_is_read_like_json(cast: Cast) -> None:
    created = await ask(cast)
    reply = await send(
        cast.api.client,
        "POST",
        f"/v1/questions/{created['id']}/cancel",
        cast.agent,
        body={"reason": "über"},
        msgpack_body=True,
    )
    assert reply.status == 200
    assert reply.content_type == "application/json"
    assert reply.body["question"]["cancellation"] == {"by": "deploybot", "reason": "über"}


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [
        ("application/msgpack", "application/msgpack"),
        ("application/msgpack;q=0", "application/json"),
        ("application/msgpack;Q=0", "application/json"),  # parameter names are case-insensitive
        ("application/msgpack; q=0.0, */*", "application/json"),
        ("application/msgpack;q=nan", "application/json"),
        ("application/msgpack;q=7", "application/json"),
        ("application/json;q=0.5, application/msgpack", "application/msgpack"),
        ("application/json, application/msgpack;q=0.9", "application/json"),
        ("application/vnd.msgpack;q=0.9, */*;q=0.1", "application/msgpack"),
    ],
)
async def test_accept_chooses_msgpack_only_when_it_is_preferred_and_acceptable(
    cast: Cast, accept: str, content_type: str
) -> None:
    created = await ask(cast)
    reply = await send(cast.api.client, "GET", f"/v1/questions/{created['id']}", cast.agent, accept=accept)
    assert reply.status == 200
    assert reply.content_type == content_type
    assert reply.body == created


async def test_errors_stay_problem_json_when_msgpack_is_accepted(cast: Cast) -> None:
    reply = await send(
        cast.api.client, "GET", f"/v1/questions/{'0' * 25}", cast.agent, accept="application/msgpack"
    )
    assert_problem(reply, 404)


# -- health -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
async def test_health_routes_answer_200_without_a_token(any_api: Api, path: str) -> None:
    reply = await send(any_api.client, "GET", path)
    assert reply.status == 200, reply.data
    assert reply.content_type == "application/json"


# -- admin --------------------------------------------------------------------------------------


async def test_creating_a_principal_returns_201_and_a_working_token(any_api: Api) -> None:
    reply = await send(
        any_api.client,
        "POST",
        "/v1/admin/principals",
        any_api.admin,
        body={"id": "erin", "kind": "user", "display_name": "Erin E."},
    )
    assert reply.status == 201, reply.data
    assert reply.body["principal"] == {"id": "erin", "kind": "user", "display_name": "Erin E."}
    token = reply.body["token"]
    assert isinstance(token, str)
    works = await send(any_api.client, "GET", "/v1/questions", token)
    assert works.status == 200


@pytest.mark.parametrize("kind", ["agent", "user", "admin"])
async def test_a_principal_named_as_the_bootstrap_admin_is_409_and_writes_nothing(
    any_api: Api, kind: str
) -> None:
    """It would share QS_ADMIN_TOKEN's event stream and its name in `cancellation.by`."""
    async with Unchanged(any_api):
        reply = await send(
            any_api.client, "POST", "/v1/admin/principals", any_api.admin, body={"id": "admin", "kind": kind}
        )
    assert_problem(reply, 409)


@pytest.mark.parametrize("kind", ["agent", "user", "admin"])
async def test_creating_a_principal_twice_is_409(any_api: Api, kind: str) -> None:
    await any_api.principal("twice", kind)
    async with Unchanged(any_api):
        again = await send(
            any_api.client,
            "POST",
            "/v1/admin/principals",
            any_api.admin,
            body={"id": "twice", "kind": "user"},
        )
    assert_problem(again, 409)


async def test_a_created_admin_principal_may_use_admin_routes(any_api: Api) -> None:
    root = await any_api.principal("root", "admin")
    made = await send(
        any_api.client, "POST", "/v1/admin/principals", root, body={"id": "frank", "kind": "agent"}
    )
    assert made.status == 201
    assert made.body["principal"]["kind"] == "agent"


async def test_tokens_are_random_and_stored_only_as_hashes(any_api: Api) -> None:
    first = await any_api.principal("gina", "user")
    second = await send(any_api.client, "POST", "/v1/admin/principals/gina/tokens", any_api.admin)
    assert second.status == 201
    tokens = [first, second.body["token"]]
    assert tokens[0] != tokens[1]
    for token in tokens:
        assert len(token) >= 22  # >= 128 bits in any printable encoding
    stored = await snapshot(redis_of(any_api), settings_of(any_api).key_prefix)
    text = repr(stored)
    for token in tokens:
        assert token not in text, "a token is stored in clear"


async def test_an_issued_token_works_alongside_the_old_one(any_api: Api) -> None:
    old = await any_api.principal("hank", "user")
    issued = await send(any_api.client, "POST", "/v1/admin/principals/hank/tokens", any_api.admin)
    assert issued.status == 201, issued.data
    assert issued.body["principal"]["id"] == "hank"
    for token in (old, issued.body["token"]):
        assert (await send(any_api.client, "GET", "/v1/questions", token)).status == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_bearer_scheme_is_case_insensitive(cast: Cast, scheme: str) -> None:
    reply = await send(
        cast.api.client, "GET", "/v1/questions", headers={"Authorization": f"{scheme} {cast.alice}"}
    )
    assert reply.status == 200, reply.data


@pytest.mark.parametrize("reference", ["token_id", "prefix", "whole"])
async def test_a_revoked_token_is_401(any_api: Api, reference: str) -> None:
    await any_api.principal("ivan", "user")
    issued = await send(any_api.client, "POST", "/v1/admin/principals/ivan/tokens", any_api.admin)
    token, token_id = issued.body["token"], issued.body["token_id"]
    ref = {"token_id": token_id, "prefix": f"qs_{token_id}", "whole": token}[reference]
    revoked = await send(any_api.client, "DELETE", f"/v1/admin/tokens/{ref}", any_api.admin)
    assert revoked.status == 204, revoked.data
    after = await send(any_api.client, "GET", "/v1/questions", token)
    assert_problem(after, 401)
    again = await send(any_api.client, "DELETE", f"/v1/admin/tokens/{ref}", any_api.admin)
    assert_problem(again, 404)


@pytest.mark.parametrize("secret", ["x", "A" * 43], ids=["not-a-token", "another-secret"])
async def test_a_whole_token_with_another_secret_revokes_nothing(any_api: Api, secret: str) -> None:
    """Only the token itself, its id or its public prefix names it: a string that merely starts
    with the prefix is another token, or none."""
    await any_api.principal("ivan", "user")
    issued = await send(any_api.client, "POST", "/v1/admin/principals/ivan/tokens", any_api.admin)
    token, token_id = issued.body["token"], issued.body["token_id"]
    wrong = f"qs_{token_id}_{secret}"
    assert_problem(await send(any_api.client, "DELETE", f"/v1/admin/tokens/{wrong}", any_api.admin), 404)
    assert (await send(any_api.client, "GET", "/v1/questions", token)).status == 200


@pytest.mark.parametrize("route", ["wait", "batch-wait"])
async def test_a_long_poll_whose_token_is_revoked_while_parked_returns_401_not_the_answer(
    api: Api, route: str
) -> None:
    agent = await api.principal("ivy-bot", "agent")
    alice = await api.principal("ivy", "user")
    question = (await api.ask(agent, {"user": "ivy"}))["id"]
    path, body = f"/v1/questions/{question}/wait?timeout=10", None
    if route == "batch-wait":
        path, body = "/v1/questions/wait", {"ids": [question], "timeout": 10, "mode": "any"}
    method = "GET" if body is None else "POST"
    parked = asyncio.create_task(send(api.client, method, path, agent, body=body))
    await parked_waiters(api, 1)
    revoked = await send(api.client, "DELETE", f"/v1/admin/tokens/{agent}", api.admin)
    assert revoked.status == 204, revoked.data
    assert (await api.answer(alice, question, "yes")).status == 200
    assert_problem(await parked, 401)


async def test_a_revoke_that_failed_on_a_redis_error_can_be_retried_and_then_holds(
    any_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 invites a retry: the retry must find the token (not 404) and end it."""
    await any_api.principal("ivan", "user")
    issued = await send(any_api.client, "POST", "/v1/admin/principals/ivan/tokens", any_api.admin)
    token, token_id = issued.body["token"], issued.body["token_id"]
    redis = any_api.client.app[DIRECTORY].redis
    real_delete = redis.delete

    async def fails_once(*keys: Any) -> Any:
        monkeypatch.setattr(redis, "delete", real_delete)
        raise RedisConnectionError("Redis went away mid-revoke")

    monkeypatch.setattr(redis, "delete", fails_once)
    failed = await send(any_api.client, "DELETE", f"/v1/admin/tokens/{token_id}", any_api.admin)
    assert_problem(failed, 503)
    retried = await send(any_api.client, "DELETE", f"/v1/admin/tokens/{token_id}", any_api.admin)
    assert retried.status == 204, retried.data
    assert_problem(await send(any_api.client, "GET", "/v1/questions", token), 401)


async def test_a_lookup_that_read_a_token_before_its_revoke_does_not_cache_it_again(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that read the token just before the revoke's DEL put it back into the cache
    the revoke had just dropped: the revoking process accepted it for QS_AUTH_CACHE_SECONDS."""
    client = await start_client(settings_for(redis_server.url, auth_cache_seconds=60))
    try:
        await token_read_across_a_revoke(Api(client, ADMIN_TOKEN), monkeypatch)
    finally:
        await close_client(client)


async def token_read_across_a_revoke(any_api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    await any_api.principal("ivan", "user")
    issued = await send(any_api.client, "POST", "/v1/admin/principals/ivan/tokens", any_api.admin)
    token, token_id = issued.body["token"], issued.body["token_id"]
    directory = any_api.client.app[DIRECTORY]
    real_principal = directory.principal
    token_read, revoked = asyncio.Event(), asyncio.Event()

    async def held_until_revoked(principal_id: str) -> Any:
        token_read.set()
        await revoked.wait()
        return await real_principal(principal_id)

    monkeypatch.setattr(directory, "principal", held_until_revoked)
    in_flight = asyncio.create_task(send(any_api.client, "GET", "/v1/me", token))
    await asyncio.wait_for(token_read.wait(), 5)
    assert (await directory.revoke_token(token_id)) is True
    revoked.set()
    assert (await in_flight).status == 200  # it read the token before the revoke
    monkeypatch.setattr(directory, "principal", real_principal)
    assert_problem(await send(any_api.client, "GET", "/v1/me", token), 401)


async def test_a_principal_create_that_failed_partway_leaves_nothing_and_its_retry_works(
    any_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The principal and its first token are written together: a create that failed before its
    token existed must not leave a principal behind that turns the retry into a 409."""
    real_new_token = auth_module.new_token

    def fails_once() -> tuple[str, str]:
        monkeypatch.setattr(auth_module, "new_token", real_new_token)
        raise RedisConnectionError("Redis went away mid-create")

    monkeypatch.setattr(auth_module, "new_token", fails_once)
    body = {"id": "judy", "kind": "user"}
    failed = await send(any_api.client, "POST", "/v1/admin/principals", any_api.admin, body=body)
    assert_problem(failed, 503)
    retried = await send(any_api.client, "POST", "/v1/admin/principals", any_api.admin, body=body)
    assert retried.status == 201, retried.data
    assert (await send(any_api.client, "GET", "/v1/questions", retried.body["token"])).status == 200


async def test_token_routes_for_unknown_principals_and_tokens_are_404(any_api: Api) -> None:
    async with Unchanged(any_api):
        issue = await send(any_api.client, "POST", "/v1/admin/principals/nobody/tokens", any_api.admin)
        revoke = await send(any_api.client, "DELETE", "/v1/admin/tokens/0123456789ab", any_api.admin)
    assert_problem(issue, 404)
    assert_problem(revoke, 404)


async def test_room_membership_is_replaced_read_added_and_removed(any_api: Api) -> None:
    for user in ("jan", "kim", "lou"):
        await any_api.principal(user, "user")
    client, admin = any_api.client, any_api.admin
    put = await send(client, "PUT", "/v1/admin/rooms/night", admin, body={"members": ["jan", "kim"]})
    assert put.status == 200, put.data
    assert put.body == {"room": "night", "members": ["jan", "kim"]}
    replaced = await send(client, "PUT", "/v1/admin/rooms/night", admin, body={"members": ["kim"]})
    assert replaced.body == {"room": "night", "members": ["kim"]}
    assert (await send(client, "GET", "/v1/admin/rooms/night", admin)).body == {
        "room": "night",
        "members": ["kim"],
    }

    added = await send(client, "PUT", "/v1/admin/rooms/night/members/lou", admin)
    assert added.status == 200, added.data
    assert sorted(added.body["members"]) == ["kim", "lou"]
    removed = await send(client, "DELETE", "/v1/admin/rooms/night/members/kim", admin)
    assert removed.status == 204
    assert (await send(client, "GET", "/v1/admin/rooms/night", admin)).body == {
        "room": "night",
        "members": ["lou"],
    }


async def test_room_routes_refuse_unknown_rooms_users_and_members(any_api: Api) -> None:
    await any_api.principal("mia", "user")
    await any_api.principal("robot", "agent")
    await any_api.room("day", ["mia"])
    client, admin = any_api.client, any_api.admin
    async with Unchanged(any_api):
        unknown_user = await send(
            client, "PUT", "/v1/admin/rooms/day", admin, body={"members": ["mia", "ghost"]}
        )
        agent_member = await send(client, "PUT", "/v1/admin/rooms/day/members/robot", admin)
        unknown_room = await send(client, "GET", "/v1/admin/rooms/nowhere", admin)
        add_to_unknown = await send(client, "PUT", "/v1/admin/rooms/nowhere/members/mia", admin)
        not_a_member = await send(client, "DELETE", "/v1/admin/rooms/day/members/robot", admin)
    assert_problem(unknown_user, 422)
    assert_problem(agent_member, 422)
    assert_problem(unknown_room, 404)
    assert_problem(add_to_unknown, 404)
    assert_problem(not_a_member, 404)
