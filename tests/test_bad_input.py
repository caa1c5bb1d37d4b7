"""Bad input: every refusal is a clear 4xx RFC 9457 problem (never a 500, never a stack trace),
and NOTHING is written: every Redis key under the test's prefix is the same before and after.

Runs against the real Redis (`api`): what is refused here is decided before any script runs.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from datetime import timedelta
from typing import Any

import msgpack
import pytest
from multidict import CIMultiDict

from tests.api import Api
from tests.helpers_contract import (
    Cast,
    Unchanged,
    assert_problem,
    make_cast,
    now_utc,
    question_body,
    send,
    settings_of,
)

ALICE = {"user": "alice"}
OK_OPTIONS = [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}]


@pytest.fixture
async def cast(api: Api) -> Cast:
    return await make_cast(api)


@pytest.fixture
async def question(cast: Cast) -> str:
    """A pending question from deploybot to alice."""
    reply = await send(cast.api.client, "POST", "/v1/questions", cast.agent, body=question_body(ALICE))
    assert reply.status == 201
    question_id: str = reply.body["id"]
    return question_id


async def refused(
    api: Api,
    status: int | tuple[int, ...],
    method: str,
    path: str,
    token: str | None,
    **request: Any,
) -> dict[str, Any]:
    """Send a request that must be refused with `status` and must write nothing."""
    async with Unchanged(api, f"{method} {path}"):
        reply = await send(api.client, method, path, token, **request)
    return assert_problem(reply, status)


def options(*ids: str, label: str = "Option") -> list[dict[str, str]]:
    return [{"id": i, "label": label} for i in ids]


def in_days(days: float, *, tz: bool = True) -> str:
    moment = now_utc() + timedelta(days=days)
    text = moment.isoformat(timespec="milliseconds")
    return text if tz else text.replace("+00:00", "")


# -- malformed bodies ---------------------------------------------------------------------------

NESTED = b"[" * 30_000 + b"]" * 30_000

MALFORMED_JSON = {
    "truncated": b'{"prompt": "Proceed?", "options": [',
    "not-json": b"proceed please",
    "trailing-garbage": b'{"prompt": "x"}}',
    "single-quotes": b"{'prompt': 'x'}",
    "nan-literal": b'{"prompt": "x", "expires_in": NaN}',
    "infinity-literal": b'{"prompt": "x", "expires_in": Infinity}',
    "invalid-utf8": b'{"prompt": "\xff\xfe"}',
    "empty": b"",
    "whitespace-only": b"   ",
}


@pytest.mark.parametrize("raw", MALFORMED_JSON.values(), ids=MALFORMED_JSON.keys())
async def test_malformed_json_is_400(cast: Cast, raw: bytes) -> None:
    await refused(
        cast.api, 400, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/json"
    )


async def test_json_nested_beyond_reason_is_refused_not_a_500(cast: Cast) -> None:
    raw = b'{"prompt": "x", "metadata": {"deep": ' + NESTED + b"}}"
    assert len(raw) < settings_of(cast.api).max_body_bytes
    await refused(
        cast.api, (400, 422), "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/json"
    )


OPTIONS_AND_DEADLINE = (
    b'"options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}], "expires_in": 60'
)
REPEATED_KEYS = {  # each body is valid but for the repeated key
    "top-level": b'{"prompt": "Deploy?", "prompt": "Roll back?", "to": {"user": "alice"}, ',
    "nested": b'{"prompt": "Deploy?", "to": {"user": "alice", "user": "alice"}, ',
    "in-metadata": b'{"prompt": "Deploy?", "metadata": {"a": 1, "a": 2}, "to": {"user": "alice"}, ',
}


@pytest.mark.parametrize("head", REPEATED_KEYS.values(), ids=REPEATED_KEYS.keys())
async def test_a_json_key_named_twice_in_one_object_is_400_and_nothing_is_written(
    cast: Cast, head: bytes
) -> None:
    raw = head + OPTIONS_AND_DEADLINE + b"}"
    problem = await refused(
        cast.api, 400, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/json"
    )
    assert "more than once" in problem["detail"]


async def test_a_msgpack_key_named_twice_in_one_map_is_400_and_nothing_is_written(cast: Cast) -> None:
    body = question_body(ALICE)
    packer = msgpack.Packer()
    raw = packer.pack_map_header(len(body) + 1) + packer.pack("prompt") + packer.pack("Roll back?")
    raw += b"".join(packer.pack(key) + packer.pack(value) for key, value in body.items())
    problem = await refused(
        cast.api, 400, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/msgpack"
    )
    assert "more than once" in problem["detail"]


MALFORMED_MSGPACK = {
    "reserved-byte": b"\xc1",
    "truncated-map": b"\x83\xa6prompt",
    "trailing-data": msgpack.packb({"prompt": "x"}) + b"\x01",
    "invalid-utf8-str": b"\x81\xa6prompt\xa2\xff\xfe",
    "truncated-str": b"\x81\xa6prompt\xda\x00\x10abc",
    "deep-nesting": b"\x91" * 5000 + b"\xc0",
}


@pytest.mark.parametrize("raw", MALFORMED_MSGPACK.values(), ids=MALFORMED_MSGPACK.keys())
async def test_malformed_msgpack_is_400_and_says_why(cast: Cast, raw: bytes) -> None:
    problem = await refused(
        cast.api, 400, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/msgpack"
    )
    assert not problem["detail"].endswith(": "), problem["detail"]


async def test_a_json_number_of_5000_digits_is_400_without_python_advice(cast: Cast) -> None:
    raw = b'{"prompt": "x", "expires_in": ' + b"1" * 5000 + b"}"
    problem = await refused(
        cast.api, 400, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/json"
    )
    assert problem["detail"] == "the body holds a number of more than 4300 digits"


@pytest.mark.parametrize("code", [5, 127, -5, -128], ids=["ext-5", "ext-127", "ext-minus-5", "ext-minus-128"])
async def test_msgpack_extension_types_are_400(cast: Cast, code: int) -> None:
    packed = msgpack.packb(
        question_body(ALICE, metadata={"x": msgpack.ExtType(1, b"\x00")}), use_bin_type=True
    )
    # fixext 1 (0xd4), then the type as a signed byte: msgpack's packer refuses negative types.
    raw = packed.replace(b"\xd4\x01\x00", b"\xd4" + code.to_bytes(1, "big", signed=True) + b"\x00")
    assert raw != packed
    await refused(
        cast.api, 400, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/msgpack"
    )


@pytest.mark.parametrize("where", ["metadata", "prompt", "expires_in"])
async def test_a_msgpack_timestamp_extension_is_refused(cast: Cast, where: str) -> None:
    """The timestamp (ext -1) is decoded natively by msgpack, so it may fail as a wrong type (422)
    rather than as an unreadable body (400); either way it is refused and nothing is written."""
    stamp = msgpack.Timestamp(1_700_000_000, 0)
    body = question_body(ALICE, **{where: {"at": stamp} if where == "metadata" else stamp})
    raw = msgpack.packb(body, use_bin_type=True, datetime=False)
    await refused(
        cast.api, (400, 422), "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/msgpack"
    )


async def test_msgpack_binary_in_metadata_is_422(cast: Cast) -> None:
    body = question_body(ALICE, metadata={"blob": b"\x00\x01"})
    await refused(cast.api, 422, "POST", "/v1/questions", cast.agent, body=body, msgpack_body=True)


async def test_msgpack_non_finite_number_in_metadata_is_422(cast: Cast) -> None:
    body = question_body(ALICE, metadata={"ratio": float("nan")})
    await refused(cast.api, 422, "POST", "/v1/questions", cast.agent, body=body, msgpack_body=True)


async def test_msgpack_non_string_keys_are_refused(cast: Cast) -> None:
    raw = msgpack.packb({**question_body(ALICE), 7: "seven"}, use_bin_type=True)
    await refused(
        cast.api, (400, 422), "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/msgpack"
    )


# -- wrong types, unknown fields, out-of-range values on create -------------------------------

INVALID_ASKS: dict[str, dict[str, Any]] = {
    # wrong types
    "body-is-an-array": {"__raw__": []},
    "body-is-a-string": {"__raw__": "ask alice"},
    "body-is-null": {"__raw__": None},
    "prompt-number": {"prompt": 5},
    "prompt-null": {"prompt": None},
    "options-string": {"options": "yes,no"},
    "options-of-strings": {"options": ["yes", "no"]},
    "option-label-number": {"options": [{"id": "yes", "label": 1}, {"id": "no", "label": "No"}]},
    "to-string": {"to": "alice"},
    "to-user-number": {"to": {"user": 5}},
    "expires-in-string": {"expires_in": "60"},
    "expires-in-float": {"expires_in": 1.5},
    "expires-in-bool": {"expires_in": True},
    "expires-at-number": {"expires_in": ..., "expires_at": 1_900_000_000},
    "metadata-array": {"metadata": [1, 2]},
    "metadata-string": {"metadata": "x"},
    # missing or unknown fields
    "missing-prompt": {"prompt": ...},
    "missing-options": {"options": ...},
    "missing-to": {"to": ...},
    "unknown-top-level-field": {"colour": "red"},
    "unknown-option-field": {"options": [{"id": "yes", "label": "Y", "emoji": "+"}, *OK_OPTIONS[1:]]},
    "unknown-to-field": {"to": {"user": "alice", "team": "ops"}},
    "to-empty": {"to": {}},
    "to-user-and-room": {"to": {"user": "alice", "room": "ops"}},
    # out of range
    "prompt-empty": {"prompt": ""},
    "prompt-2001-chars": {"prompt": "p" * 2001},
    "one-option": {"options": options("yes")},
    "eleven-options": {"options": options(*(f"o{i}" for i in range(11)))},
    "no-options": {"options": []},
    "duplicate-option-ids": {"options": options("yes", "yes")},
    "option-id-uppercase": {"options": options("Yes", "no")},
    "option-id-space": {"options": options("a b", "no")},
    "option-id-33-chars": {"options": options("x" * 33, "no")},
    "option-id-empty": {"options": options("", "no")},
    "option-id-non-ascii": {"options": options("é", "no")},
    "option-id-trailing-newline": {"options": options("yes\n", "no")},
    "option-id-dot": {"options": options("y.es", "no")},
    "label-empty": {"options": [{"id": "yes", "label": ""}, OK_OPTIONS[1]]},
    "label-81-chars": {"options": [{"id": "yes", "label": "l" * 81}, OK_OPTIONS[1]]},
    "expires-in-0": {"expires_in": 0},
    "expires-in-negative": {"expires_in": -1},
    "expires-in-2592001": {"expires_in": 2_592_001},
    "expires-in-huge": {"expires_in": 10**30},
    "expires-at-in-the-past": {"expires_in": ..., "expires_at": "2000-01-01T00:00:00.000Z"},
    "expires-at-now-ish": {"expires_in": ..., "expires_at": in_days(-1 / 86400)},
    "expires-at-without-timezone": {"expires_in": ..., "expires_at": in_days(1, tz=False)},
    "expires-at-over-30-days": {"expires_in": ..., "expires_at": in_days(30.01)},
    "expires-at-far-future": {"expires_in": ..., "expires_at": "9999-12-31T23:59:59.999Z"},
    "expires-at-not-a-date": {"expires_in": ..., "expires_at": "tomorrow"},
    "expires-at-date-only": {"expires_in": ..., "expires_at": "2031-01-01"},
    "expires-at-without-seconds": {"expires_in": ..., "expires_at": in_days(1)[:16] + "Z"},
    "expires-at-basic-format": {
        "expires_in": ...,
        "expires_at": (now_utc() + timedelta(days=1)).strftime("%Y%m%dT%H%M%SZ"),
    },
    "expires-in-and-expires-at": {"expires_at": in_days(1)},
    "neither-expires-in-nor-at": {"expires_in": ...},
    "metadata-over-8-KiB": {"metadata": {"blob": "m" * (8 * 1024)}},
    "metadata-over-8-KiB-when-encoded": {"metadata": {"blob": "é" * 4100}},
    "target-user-with-a-trailing-newline": {"to": {"user": "alice\n"}},
}


@pytest.mark.parametrize("changes", INVALID_ASKS.values(), ids=INVALID_ASKS.keys())
async def test_an_invalid_question_is_422_and_nothing_is_written(cast: Cast, changes: dict[str, Any]) -> None:
    body = changes["__raw__"] if "__raw__" in changes else question_body(ALICE, **changes)
    problem = await refused(
        cast.api,
        422,
        "POST",
        "/v1/questions",
        cast.agent,
        raw=json.dumps(body).encode(),
        content_type="application/json",
    )
    assert "regex" not in problem["detail"], problem["detail"]  # the rule in words, not its regex


@pytest.mark.parametrize("field", ["prompt", "label", "metadata-value", "metadata-key"])
async def test_a_lone_surrogate_is_refused_not_a_500(cast: Cast, field: str) -> None:
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"); it is no Unicode text and cannot be
    stored as UTF-8, so it must be refused like any other invalid string."""
    body = question_body(ALICE)
    if field == "prompt":
        body["prompt"] = "deploy \ud800?"
    elif field == "label":
        body["options"] = [{"id": "yes", "label": "Y\udfff"}, OK_OPTIONS[1]]
    elif field == "metadata-value":
        body["metadata"] = {"note": "\ud83d"}
    else:
        body["metadata"] = {"\ud800": 1}
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800
    await refused(
        cast.api, (400, 422), "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/json"
    )


async def test_the_limits_themselves_are_accepted(cast: Cast) -> None:
    """The boundaries of every range above are valid: the refusals are not off by one."""
    accepted = [
        {"prompt": "p" * 2000},
        {"options": options("a", "b")},
        {"options": options(*(f"o{i}" for i in range(10)))},
        {"options": [{"id": "x" * 32, "label": "l" * 80}, {"id": "a_b-9", "label": "L"}]},
        {"expires_in": 1},
        {"expires_in": 2_592_000},
        {"expires_in": ..., "expires_at": in_days(29.99)},
        {"metadata": {"blob": "m" * (8 * 1024 - len('{"blob":""}'))}},
    ]
    for changes in accepted:
        reply = await send(
            cast.api.client, "POST", "/v1/questions", cast.agent, body=question_body(ALICE, **changes)
        )
        assert reply.status == 201, (changes if len(str(changes)) < 200 else list(changes), reply.data)


# -- answer, cancel and admin bodies ------------------------------------------------------------

INVALID_ANSWERS: dict[str, tuple[int, Any]] = {
    "malformed-json": (400, b'{"option": '),
    "empty-body": (400, b""),
    "body-is-an-array": (422, b'["yes"]'),
    "body-is-null": (422, b"null"),
    "option-number": (422, b'{"option": 1}'),
    "option-null": (422, b'{"option": null}'),
    "option-missing": (422, b"{}"),
    "unknown-field": (422, b'{"option": "yes", "comment": "sure"}'),
    "unknown-option": (422, b'{"option": "maybe"}'),
    "empty-option": (422, b'{"option": ""}'),
    "identity-field": (400, b'{"option": "yes", "responder": "bob"}'),
    "lone-surrogate-option": ((400, 422), b'{"option": "\\ud800"}'),
}


@pytest.mark.parametrize(("status", "raw"), INVALID_ANSWERS.values(), ids=INVALID_ANSWERS.keys())
async def test_an_invalid_answer_is_refused_and_nothing_is_written(
    cast: Cast, question: str, status: int | tuple[int, ...], raw: bytes
) -> None:
    path = f"/v1/questions/{question}/answer"
    await refused(cast.api, status, "POST", path, cast.alice, raw=raw, content_type="application/json")


INVALID_CANCELS: dict[str, tuple[int, bytes]] = {
    "malformed-json": (400, b'{"reason": '),
    "body-is-an-array": (422, b"[]"),
    "body-is-null": (422, b"null"),
    "reason-number": (422, b'{"reason": 5}'),
    "reason-501-chars": (422, json.dumps({"reason": "r" * 501}).encode()),
    "unknown-field": (422, b'{"reason": "x", "force": true}'),
}


@pytest.mark.parametrize(("status", "raw"), INVALID_CANCELS.values(), ids=INVALID_CANCELS.keys())
async def test_an_invalid_cancel_is_refused_and_nothing_is_written(
    cast: Cast, question: str, status: int, raw: bytes
) -> None:
    path = f"/v1/questions/{question}/cancel"
    await refused(cast.api, status, "POST", path, cast.agent, raw=raw, content_type="application/json")


INVALID_ADMIN: dict[str, tuple[str, str, Any]] = {
    "principal-unknown-kind": ("POST", "/v1/admin/principals", {"id": "zed", "kind": "robot"}),
    "principal-missing-kind": ("POST", "/v1/admin/principals", {"id": "zed"}),
    "principal-id-uppercase": ("POST", "/v1/admin/principals", {"id": "Zed", "kind": "user"}),
    "principal-id-space": ("POST", "/v1/admin/principals", {"id": "z ed", "kind": "user"}),
    "principal-id-65-chars": ("POST", "/v1/admin/principals", {"id": "z" * 65, "kind": "user"}),
    "principal-id-trailing-newline": ("POST", "/v1/admin/principals", {"id": "zed\n", "kind": "user"}),
    "principal-id-number": ("POST", "/v1/admin/principals", {"id": 7, "kind": "user"}),
    "principal-display-name-201": (
        "POST",
        "/v1/admin/principals",
        {"id": "zed", "kind": "user", "display_name": "d" * 201},
    ),
    "principal-unknown-field": ("POST", "/v1/admin/principals", {"id": "zed", "kind": "user", "admin": True}),
    "token-expires-in-0": ("POST", "/v1/admin/principals/alice/tokens", {"expires_in": 0}),
    "token-expires-in-string": ("POST", "/v1/admin/principals/alice/tokens", {"expires_in": "60"}),
    "token-unknown-field": ("POST", "/v1/admin/principals/alice/tokens", {"scope": "all"}),
    "room-members-not-a-list": ("PUT", "/v1/admin/rooms/ops", {"members": "bob"}),
    "room-member-bad-id": ("PUT", "/v1/admin/rooms/ops", {"members": ["Bob!"]}),
    "room-member-unknown-user": ("PUT", "/v1/admin/rooms/ops", {"members": ["bob", "ghost"]}),
    "room-member-is-an-agent": ("PUT", "/v1/admin/rooms/ops", {"members": ["deploybot"]}),
    "room-unknown-field": ("PUT", "/v1/admin/rooms/ops", {"members": [], "topic": "x"}),
    "room-id-with-space": ("PUT", "/v1/admin/rooms/op%20s", {"members": ["bob"]}),
    "room-id-uppercase": ("PUT", "/v1/admin/rooms/OPS", {"members": ["bob"]}),
    "room-id-trailing-newline": ("PUT", "/v1/admin/rooms/new%0A", {"members": ["bob"]}),
    "member-unknown-user": ("PUT", "/v1/admin/rooms/ops/members/ghost", None),
}


@pytest.mark.parametrize(("method", "path", "body"), INVALID_ADMIN.values(), ids=INVALID_ADMIN.keys())
async def test_an_invalid_admin_request_is_422_and_nothing_is_written(
    cast: Cast, method: str, path: str, body: Any
) -> None:
    await refused(cast.api, 422, method, path, cast.admin, body=body)


# -- sizes and media types ----------------------------------------------------------------------

OVERSIZED_ROUTES = [
    ("POST", "/v1/questions", "agent"),
    ("POST", "/v1/questions/{q}/answer", "alice"),
    ("POST", "/v1/questions/{q}/cancel", "agent"),
    ("POST", "/v1/admin/principals", "admin"),
    ("PUT", "/v1/admin/rooms/ops", "admin"),
]


@pytest.mark.parametrize("msgpack_body", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize(
    ("method", "path", "who"), OVERSIZED_ROUTES, ids=[f"{m} {p}" for m, p, _ in OVERSIZED_ROUTES]
)
async def test_a_body_over_the_maximum_is_413(
    cast: Cast, question: str, method: str, path: str, who: str, msgpack_body: bool
) -> None:
    limit = settings_of(cast.api).max_body_bytes
    body = question_body(ALICE, prompt="p" * (limit + 1))
    token = {"agent": cast.agent, "alice": cast.alice, "admin": cast.admin}[who]
    await refused(cast.api, 413, method, path.format(q=question), token, body=body, msgpack_body=msgpack_body)


async def test_a_declared_length_over_the_maximum_is_413_before_the_body_arrives(cast: Cast) -> None:
    """Not a 408 after QS_BODY_TIMEOUT_SECONDS: the header alone says the body is too large."""
    server = cast.api.client.server
    limit = settings_of(cast.api).max_body_bytes
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        head = (
            f"POST /v1/questions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cast.agent}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n"
        )
        writer.write(head.encode() + b"{")  # and no more of the body
        async with asyncio.timeout(5):  # the body timeout is longer: a 408 would come too late
            status_line = await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()
    assert status_line.startswith(b"HTTP/1.1 413"), status_line


UNSUPPORTED_TYPES = [
    "text/plain",
    "application/xml",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/octet-stream",
    "application/cbor",
]


@pytest.mark.parametrize("content_type", UNSUPPORTED_TYPES)
@pytest.mark.parametrize("route", ["create", "answer", "cancel", "room"])
async def test_an_unsupported_content_type_is_415(
    cast: Cast, question: str, route: str, content_type: str
) -> None:
    method, path, token, body = {
        "create": ("POST", "/v1/questions", cast.agent, question_body(ALICE)),
        "answer": ("POST", f"/v1/questions/{question}/answer", cast.alice, {"option": "yes"}),
        "cancel": ("POST", f"/v1/questions/{question}/cancel", cast.agent, {"reason": "x"}),
        "room": ("PUT", "/v1/admin/rooms/ops", cast.admin, {"members": ["bob"]}),
    }[route]
    raw = json.dumps(body).encode()
    await refused(cast.api, 415, method, path, token, raw=raw, content_type=content_type)


async def test_a_body_without_content_type_is_415(cast: Cast) -> None:
    raw = json.dumps(question_body(ALICE)).encode()
    # aiohttp would label bare bytes application/octet-stream; send no header at all.
    async with (
        Unchanged(cast.api),
        cast.api.client.post(
            "/v1/questions",
            data=raw,
            headers={"Authorization": f"Bearer {cast.agent}"},
            skip_auto_headers=["Content-Type"],
        ) as response,
    ):
        status, kind, payload = response.status, response.content_type, await response.read()
    assert status == 415, payload
    assert kind == "application/problem+json"


# -- unknown ids, routes and methods ------------------------------------------------------------

UNKNOWN_IDS = {
    "well-formed": "0" * 25,
    "well-formed-f": "f" * 25,
    "too-short": "0" * 24,
    "too-long": "0" * 26,
    "uppercase-hex": "A" * 25,
    "not-hex": "nope",
    "trailing-newline": "0" * 25 + "%0A",
    "percent-junk": "%E2%98%83",
}
ID_ROUTES = {
    "fetch": ("GET", "/v1/questions/{id}", None),
    "wait": ("GET", "/v1/questions/{id}/wait?timeout=0", None),
    "answer": ("POST", "/v1/questions/{id}/answer", {"option": "yes"}),
    "cancel": ("POST", "/v1/questions/{id}/cancel", {"reason": "x"}),
}


@pytest.mark.parametrize("question_id", UNKNOWN_IDS.values(), ids=UNKNOWN_IDS.keys())
@pytest.mark.parametrize("route", ID_ROUTES.keys())
async def test_an_unknown_question_id_is_404(cast: Cast, question: str, route: str, question_id: str) -> None:
    method, path, body = ID_ROUTES[route]
    token = cast.alice if route == "answer" else cast.agent
    await refused(cast.api, 404, method, path.format(id=question_id), token, body=body)


async def test_an_unknown_route_is_a_404_problem(cast: Cast) -> None:
    await refused(cast.api, 404, "GET", "/v1/nothing-here", cast.agent)


async def test_a_wrong_method_is_a_405_problem(cast: Cast, question: str) -> None:
    problem = await refused(cast.api, 405, "DELETE", f"/v1/questions/{question}", cast.agent)
    assert problem["status"] == 405


# -- query parameters ---------------------------------------------------------------------------

BAD_QUERIES = {
    "list-unknown-param": ("GET", "/v1/questions?colour=red", "agent"),
    "list-limit-0": ("GET", "/v1/questions?limit=0", "agent"),
    "list-limit-201": ("GET", "/v1/questions?limit=201", "agent"),
    "list-limit-negative": ("GET", "/v1/questions?limit=-1", "agent"),
    "list-limit-not-a-number": ("GET", "/v1/questions?limit=ten", "agent"),
    "list-limit-fraction": ("GET", "/v1/questions?limit=1.5", "agent"),
    "list-limit-superscript-digit": ("GET", "/v1/questions?limit=%C2%B2", "agent"),
    "list-unknown-state": ("GET", "/v1/questions?state=open", "agent"),
    "list-unknown-role": ("GET", "/v1/questions?role=owner", "agent"),
    "wait-timeout-not-a-number": ("GET", "/v1/questions/{q}/wait?timeout=soon", "agent"),
    "wait-timeout-negative": ("GET", "/v1/questions/{q}/wait?timeout=-1", "agent"),
    "wait-timeout-nan": ("GET", "/v1/questions/{q}/wait?timeout=nan", "agent"),
    "wait-timeout-infinite": ("GET", "/v1/questions/{q}/wait?timeout=inf", "agent"),
    "wait-timeout-underscore": ("GET", "/v1/questions/{q}/wait?timeout=1_0", "agent"),
    "wait-timeout-full-width": ("GET", "/v1/questions/{q}/wait?timeout=%EF%BC%92", "agent"),
    "wait-timeout-spaces": ("GET", "/v1/questions/{q}/wait?timeout=%20%202%20", "agent"),
    "wait-timeout-plus": ("GET", "/v1/questions/{q}/wait?timeout=%2B2", "agent"),
    "wait-timeout-trailing-dot": ("GET", "/v1/questions/{q}/wait?timeout=2.", "agent"),
    "wait-timeout-overflowing": ("GET", "/v1/questions/{q}/wait?timeout=1e999", "agent"),
    # A typo must not silently change meaning: ?timout=5 would otherwise wait the default.
    "wait-unknown-param": ("GET", "/v1/questions/{q}/wait?timeout=0&timout=5", "agent"),
    "fetch-unknown-param": ("GET", "/v1/questions/{q}?fields=all", "agent"),
    "create-unknown-param": ("POST", "/v1/questions?dry_run=1", "agent"),
    "answer-unknown-param": ("POST", "/v1/questions/{q}/answer?dry_run=1", "alice"),
    "cancel-unknown-param": ("POST", "/v1/questions/{q}/cancel?dry_run=1", "agent"),
    "list-repeated-limit": ("GET", "/v1/questions?limit=1&limit=500", "agent"),
    "wait-repeated-timeout": ("GET", "/v1/questions/{q}/wait?timeout=0&timeout=30", "agent"),
}


@pytest.mark.parametrize(("method", "path", "who"), BAD_QUERIES.values(), ids=BAD_QUERIES.keys())
async def test_a_bad_or_unknown_query_parameter_is_422_and_nothing_is_written(
    cast: Cast, question: str, method: str, path: str, who: str
) -> None:
    token = cast.alice if who == "alice" else cast.agent
    body = None
    if method == "POST":
        body = {"option": "yes"} if "answer" in path else {} if "cancel" in path else question_body(ALICE)
    await refused(cast.api, 422, method, path.format(q=question), token, body=body)


# -- tokens -------------------------------------------------------------------------------------


async def test_an_expired_token_is_401_and_nothing_is_written(cast: Cast) -> None:
    issued = await send(
        cast.api.client, "POST", "/v1/admin/principals/deploybot/tokens", cast.admin, body={"expires_in": 1}
    )
    assert issued.status == 201, issued.data
    token = issued.body["token"]
    assert (await send(cast.api.client, "GET", "/v1/questions", token)).status == 200
    await asyncio.sleep(1.1)
    problem = await refused(cast.api, 401, "POST", "/v1/questions", token, body=question_body(ALICE))
    assert problem["status"] == 401


@pytest.mark.parametrize(("header", "status"), [("Authorization", 401), ("Idempotency-Key", 422)])
async def test_a_header_that_names_a_credential_or_key_twice_is_refused_and_writes_nothing(
    cast: Cast, header: str, status: int
) -> None:
    """Two values and no rule for which counts: a proxy may have checked the other one."""
    values = {
        "Authorization": (f"Bearer {cast.agent}", f"Bearer {cast.alice}"),
        "Idempotency-Key": ("a", "b"),
    }
    headers = CIMultiDict([("Content-Type", "application/json"), ("Authorization", f"Bearer {cast.agent}")])
    if header == "Authorization":
        headers.popall("Authorization")
    for value in values[header]:
        headers.add(header, value)
    async with Unchanged(cast.api):
        response = await cast.api.client.post(
            "/v1/questions", data=json.dumps(question_body(ALICE)), headers=headers
        )
        data = await response.read()
    assert response.status == status, data
    assert response.content_type == "application/problem+json"
    assert "not several" in json.loads(data)["detail"]


@pytest.mark.parametrize(
    "authorization",
    [
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer qs_000000000000_" + "A" * 43,
        "Bearer " + "x" * 5000,
    ],
    ids=["empty", "scheme-only", "blank-token", "basic-scheme", "unknown-token", "huge-token"],
)
async def test_a_missing_or_unknown_token_is_401_with_a_bearer_challenge(
    cast: Cast, authorization: str
) -> None:
    async with Unchanged(cast.api):
        reply = await send(
            cast.api.client,
            "POST",
            "/v1/questions",
            body=question_body(ALICE),
            headers={"Authorization": authorization},
        )
    assert_problem(reply, 401)
    assert reply.headers.get("WWW-Authenticate", "").lower().startswith("bearer")


# -- found in the eighth session's review: each was a 500 or wrote something ----------------------


async def test_an_option_spanning_two_option_ids_is_refused_and_the_question_stays_pending(
    cast: Cast,
) -> None:
    question = await cast.api.ask(cast.agent, ALICE)  # options yes and no: stored as '|yes|no|'
    path = f"/v1/questions/{question['id']}/answer"
    await refused(cast.api, 422, "POST", path, cast.alice, body={"option": "yes|no"})
    assert (await cast.api.get(cast.agent, question["id"])).body["state"] == "pending"


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/questions"), ("PUT", "/v1/me/channels/c1")],
)
async def test_utf8_encoded_lone_surrogates_are_400_and_nothing_is_written(
    cast: Cast, method: str, path: str
) -> None:
    # ED A0 80 is U+D800 written as UTF-8: not valid UTF-8, and no \u escape to give it away.
    raw = b'{"prompt": "x\xed\xa0\x80y", "kind": "ntfy", "url": "https://ntfy.sh/\xed\xa0\x80"}'
    token = cast.agent if path == "/v1/questions" else cast.alice
    await refused(cast.api, 400, method, path, token, raw=raw, content_type="application/json")


async def test_a_bearer_token_of_undecodable_bytes_is_401(cast: Cast) -> None:
    # Written on a raw socket: an HTTP client would encode the header text as UTF-8 itself.
    server = cast.api.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(
            b"GET /v1/questions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: Bearer qs_000000000000_" + b"\xe9" * 43 + b"\r\n\r\n"
        )
        status_line = await asyncio.wait_for(reader.readline(), 10)
        rest = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert status_line.split()[1] == b"401", status_line + rest
    assert b"application/problem+json" in rest


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_body_that_does_not_match_its_content_encoding_is_400_and_logs_no_error(
    cast: Cast, coding: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's mistake: aiohttp re-read the broken body after the reply and logged an
    "Unhandled exception" traceback at ERROR for each such request."""
    question = await cast.api.ask(cast.agent, ALICE)
    problem = await refused(
        cast.api,
        400,
        "POST",
        f"/v1/questions/{question['id']}/answer",
        cast.alice,
        raw=b'{"option": "yes"}',
        content_type="application/json",
        headers={"Content-Encoding": coding},
    )
    assert problem["detail"] == f"the body is not valid {coding} data, as its Content-Encoding says"
    await asyncio.sleep(0.1)  # the connection's handling after the reply
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("coding", ["zz", "compress", "gzip, zz"])
async def test_a_content_encoding_the_service_cannot_decode_is_415_not_read_as_plain(
    cast: Cast, coding: str
) -> None:
    """aiohttp passes an unknown coding through undecoded; the body was then read as if plain."""
    await refused(
        cast.api,
        415,
        "POST",
        "/v1/questions",
        cast.agent,
        raw=json.dumps(question_body(ALICE)).encode(),
        content_type="application/json",
        headers={"Content-Encoding": coding},
    )


@pytest.mark.parametrize("coding", ["identity", "GZIP", "deflate"])
async def test_the_content_encodings_aiohttp_decodes_are_read(cast: Cast, coding: str) -> None:
    raw = json.dumps(question_body(ALICE)).encode()
    compressed = {"identity": raw, "GZIP": gzip.compress(raw), "deflate": zlib.compress(raw)}[coding]
    reply = await cast.api.call(
        "POST", "/v1/questions", cast.agent, raw=compressed, headers={"Content-Encoding": coding}
    )
    assert reply.status == 201, reply.body


@pytest.mark.parametrize(
    "last", ["18446744073709551616-0", "0-18446744073709551616", "99999999999999999999-0"]
)
async def test_a_last_event_id_beyond_64_bits_is_422(cast: Cast, last: str) -> None:
    await refused(cast.api, 422, "GET", "/v1/events", cast.alice, headers={"Last-Event-ID": last})


@pytest.mark.parametrize("number", [2**64, -(2**63) - 1])
async def test_metadata_integers_beyond_64_bits_are_422(cast: Cast, number: int) -> None:
    # msgpack cannot carry them: every msgpack reply with this envelope would have been a 500.
    raw = json.dumps(question_body(ALICE, metadata={"n": number})).encode()
    await refused(
        cast.api, 422, "POST", "/v1/questions", cast.agent, raw=raw, content_type="application/json"
    )


async def test_metadata_integers_at_the_64_bit_limits_are_kept_in_msgpack_replies(cast: Cast) -> None:
    metadata = {"high": 2**64 - 1, "low": -(2**63)}
    created = await send(
        cast.api.client, "POST", "/v1/questions", cast.agent, body=question_body(ALICE, metadata=metadata)
    )
    assert created.status == 201, created.data
    fetched = await send(
        cast.api.client,
        "GET",
        f"/v1/questions/{created.body['id']}",
        cast.agent,
        accept="application/msgpack",
    )
    assert fetched.status == 200
    assert fetched.body["metadata"] == metadata
