"""Structured logs: one JSON object per line with the request id, principal, question, outcome and
latency; X-Request-Id honoured when plain and short, generated otherwise, echoed always; and no
token ever written, whatever the request carried."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from service.logs import JsonFormatter, Redactor, TextFormatter, configure_logging
from service.settings import Settings, SettingsError
from tests.api import Api, Reply
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.redis_server import RedisServer, free_port

TOKEN_SHAPE = re.compile(r"qs_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")


class Captured:
    def __init__(self) -> None:
        self.stream = io.StringIO()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def text(self) -> str:
        return self.stream.getvalue()


@pytest.fixture
def captured() -> Iterator[Captured]:
    """Every record at DEBUG and up, through the service's JSON formatter."""
    capture = Captured()
    handler = logging.StreamHandler(capture.stream)
    handler.setFormatter(JsonFormatter(Redactor((ADMIN_TOKEN,))))
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield capture
    root.removeHandler(handler)
    root.setLevel(saved)


@pytest.fixture
async def logged(redis_server: RedisServer) -> AsyncIterator[Api]:
    client: TestClient[object, object] = await start_client(settings_for(redis_server.url, access_log=True))
    yield Api(client, ADMIN_TOKEN)
    await close_client(client)


def request_id(reply: Reply) -> str:
    """The X-Request-Id of a reply (header names are case-insensitive; aiohttp sends -ID)."""
    (found,) = [v for k, v in reply.headers.items() if k.lower() == "x-request-id"]
    return found


def access_lines(capture: Captured) -> list[dict[str, Any]]:
    return [line for line in capture.lines() if line["logger"] == "service.access"]


async def test_an_access_line_carries_request_principal_question_outcome_and_latency(
    logged: Api, captured: Captured
) -> None:
    agent = await logged.principal("bot", "agent")
    alice = await logged.principal("alice", "user")
    question = await logged.ask(agent, {"user": "alice"})
    reply = await logged.call(
        "POST",
        f"/v1/questions/{question['id']}/answer",
        alice,
        {"option": "yes"},
        headers={"X-Request-Id": "req-42.a:b"},
    )
    assert reply.status == 200
    assert request_id(reply) == "req-42.a:b"
    (line,) = [x for x in access_lines(captured) if x.get("request_id") == "req-42.a:b"]
    assert line["principal"] == "alice"
    assert line["question_id"] == question["id"]
    assert line["route"] == "/v1/questions/{id}/answer"
    assert line["status"] == 200
    assert line["outcome"] == "applied"
    assert isinstance(line["latency_ms"], float)
    assert math.isfinite(line["latency_ms"])
    assert line["latency_ms"] == abs(line["latency_ms"])  # a duration, never negative
    assert line["level"] == "INFO"
    assert line["ts"].endswith("Z")
    created = [x for x in access_lines(captured) if x.get("outcome") == "created"]
    assert [x["question_id"] for x in created] == [question["id"]]


async def test_an_error_line_names_the_problem_type(logged: Api, captured: Captured) -> None:
    reply = await logged.call("GET", "/v1/questions/0123456789abcdef012345678", "qs_nope")
    assert reply.status == 401
    (line,) = access_lines(captured)
    assert line["outcome"] == "unauthenticated"
    assert "principal" not in line


async def test_a_bad_or_missing_request_id_is_replaced_by_a_generated_one(logged: Api) -> None:
    missing = await logged.call("GET", "/healthz")
    spaced = await logged.call("GET", "/healthz", headers={"X-Request-Id": "two words"})
    long = await logged.call("GET", "/healthz", headers={"X-Request-Id": "x" * 65})
    ids = [request_id(r) for r in (missing, spaced, long)]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"[0-9a-f]{9,}", i) for i in ids), ids
    problem = await logged.call("GET", "/v1/questions", headers={"X-Request-Id": "abc"})
    assert problem.status == 401
    assert request_id(problem) == "abc"


async def test_no_token_is_ever_written_to_the_log(logged: Api, captured: Captured) -> None:
    agent = await logged.principal("bot", "agent")
    issued = await logged.call("POST", "/v1/admin/principals/bot/tokens", ADMIN_TOKEN)
    spare = issued.body["token"]
    await logged.ask(agent, {"user": "alice"}, expect=422)
    await logged.call("GET", "/v1/questions?role=asker", agent)
    await logged.call("GET", "/v1/questions", spare + "x")  # unknown token: 401
    await logged.call("GET", f"/v1/questions/{spare}", agent)  # a token as the question id: 404
    revoked = await logged.call("DELETE", f"/v1/admin/tokens/{spare}", ADMIN_TOKEN)
    assert revoked.status == 204
    logging.getLogger("service.test").warning("a caller sent Authorization: Bearer %s", agent)
    text = captured.text()
    assert access_lines(captured), "nothing was logged: the test would prove nothing"
    for secret in (agent, spare, ADMIN_TOKEN):
        assert secret not in text
    assert not TOKEN_SHAPE.search(text)
    assert "Bearer [redacted]" in text


def test_the_text_format_is_one_line_with_key_values_and_redacted() -> None:
    record = logging.LogRecord("service.access", logging.INFO, __file__, 1, "GET %s", ("/x",), None)
    record.__dict__.update(route="/x", status=200, outcome="ok")
    secret = "qs_0123456789ab_" + "A" * 43
    leaky = logging.LogRecord("service", logging.WARNING, __file__, 1, "token %s", (secret,), None)
    link = "WyJhYmMiLCJhbGljZSIsInllcyIsMTc5OTk5OTk5OTk5OV0.yKbWqTzE4cw"
    path = f"/v1/actions/{link}"
    tapped = logging.LogRecord("service", logging.WARNING, __file__, 1, "down on POST %s", (path,), None)
    assert link not in TextFormatter().format(tapped)
    assert "/v1/actions/[redacted]" in JsonFormatter().format(tapped)
    text = TextFormatter().format(record)
    assert re.fullmatch(r"\S+Z INFO service.access GET /x route=/x status=200 outcome=ok", text)
    assert secret not in TextFormatter().format(leaky)
    assert secret not in JsonFormatter().format(leaky)


def test_configure_logging_honours_format_and_level() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        configure_logging(Settings(log_format="text", log_level="warning"), stream)
        logging.getLogger("service.x").info("hidden")
        logging.getLogger("service.x").warning("shown")
        assert "hidden" not in stream.getvalue()
        assert " WARNING service.x shown" in stream.getvalue()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
    with pytest.raises(SettingsError, match="QS_LOG_FORMAT"):
        Settings.from_env({"QS_LOG_FORMAT": "xml"})


async def test_serve_writes_json_lines_to_stderr(settings: Settings) -> None:
    async with serving(settings, QS_ACCESS_LOG="true") as served, aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "X-Request-Id": "from-test"}
        url = f"http://127.0.0.1:{served.port}/v1/admin/rooms/none"
        async with session.get(url, headers=headers) as r:
            assert r.status == 404
    (line,) = [x for x in served.lines() if x.get("request_id") == "from-test"]
    assert line["principal"] == "admin"
    assert line["status"] == 404
    assert line["outcome"] == "not-found"
    assert ADMIN_TOKEN not in served.stderr


async def test_an_unreadable_request_is_one_warning_line_without_a_traceback(settings: Settings) -> None:
    async with serving(settings) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
    assert status_line.split(b" ", 2)[1] == b"400"
    (line,) = [x for x in served.lines() if x["logger"] == "aiohttp.server"]
    assert line["level"] == "WARNING"
    assert "unreadable HTTP request, answered 400" in line["msg"]
    assert "exc" not in line
    assert len(line["msg"]) < 400


@dataclass
class Served:
    port: int
    stderr: str = ""

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stderr.splitlines() if line.strip()]


@asynccontextmanager
async def serving(settings: Settings, **env: str) -> AsyncIterator[Served]:
    """`python -m service serve` with the default log format, on a free port; its stderr is
    on the Served once the block ends."""
    served = Served(free_port())
    environment = {
        **os.environ,
        "QS_REDIS_URL": settings.redis_url,
        "QS_KEY_PREFIX": settings.key_prefix,
        "QS_PORT": str(served.port),
        "QS_ADMIN_TOKEN": ADMIN_TOKEN,
        **env,
    }
    environment.pop("QS_LOG_FORMAT", None)
    process = start_serve(environment)
    try:
        async with aiohttp.ClientSession() as session:
            await wait_until_serving(session, served.port)
        yield served
    finally:
        process.terminate()
        _, served.stderr = process.communicate(timeout=20)


def start_serve(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "service", "serve"], env=env, stderr=subprocess.PIPE, text=True
    )


async def wait_until_serving(session: aiohttp.ClientSession, port: int) -> None:
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        try:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as reply:
                if reply.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the service did not start")
