"""The Python SDK (service.client) against a live service on a real TCP port and a real Redis
(tests/live_service.py)."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from service.client import (
    AsyncClient,
    Client,
    Forbidden,
    InvalidArgument,
    NotFound,
    Option,
    ProblemError,
    Retry,
    Room,
    TooManyRequests,
    TransportError,
    Unavailable,
    User,
    ValidationFailed,
    WaitTimeout,
    parse_duration,
    parse_target,
)
from service.client._protocol import Wire
from service.settings import Settings
from tests.live_service import FAST, Live, on_loopback, populate, serve
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
LIMIT = "60s"  # a broken service fails a test with WaitTimeout instead of hanging it
PROBLEMS = "https://question-service.invalid/problems/"


# -- the live service's people, as SDK clients -----------------------------------------------


@pytest.fixture
async def live(settings: Settings) -> AsyncIterator[Live]:
    async with serve(settings) as url:
        yield await populate(url)


@pytest.fixture
async def agent(live: Live) -> AsyncIterator[AsyncClient]:
    async with live.client(live.agent) as client:
        yield client


@pytest.fixture
async def alice(live: Live) -> AsyncIterator[AsyncClient]:
    async with live.client(live.alice) as client:
        yield client


# -- a proxy that loses replies on purpose ----------------------------------------------------


@dataclass
class Proxy:
    """Forwards to the service, except that each request matching `path` (a regex) first takes
    the next step of `plan`: "503" (answered here with a problem), "drop" (connection closed,
    never forwarded), "lose" (forwarded, then the connection is closed instead of replying)."""

    upstream: str
    path: str = ""
    plan: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    media: list[tuple[str, str]] = field(default_factory=list)  # (Content-Type, Accept) sent

    async def handle(self, request: web.Request) -> web.StreamResponse:
        step = "forward"
        if self.plan and re.search(self.path, request.path):
            step = self.plan.pop(0)
        self.seen.append(f"{request.method} {request.path} {step}")
        self.media.append((request.headers.get("Content-Type", ""), request.headers.get("Accept", "")))
        if step == "503":
            problem = {"type": "about:blank", "title": "Unavailable", "status": 503, "detail": "proxy"}
            return web.json_response(problem, status=503, content_type="application/problem+json")
        if step == "429":  # as the service answers a principal at its QS_WAITS_PER_PRINCIPAL
            problem = {"type": PROBLEMS + "too-many-waits", "title": "Too many", "status": 429, "detail": "x"}
            return web.json_response(problem, status=429, content_type="application/problem+json")
        if step == "drop":
            return self.hang_up(request)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        target = self.upstream + request.path_qs
        async with (
            ClientSession() as session,
            session.request(request.method, target, headers=headers, data=body) as up,
        ):
            payload = await up.read()
            if step == "lose":
                return self.hang_up(request)
            kept = {"Content-Type": up.headers["Content-Type"]} if "Content-Type" in up.headers else {}
            return web.Response(status=up.status, body=payload, headers=kept)

    @staticmethod
    def hang_up(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()
        return web.Response()


@asynccontextmanager
async def proxy_to(url: str, path: str, plan: list[str]) -> AsyncIterator[tuple[str, Proxy]]:
    proxy = Proxy(url, path, plan)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    async with on_loopback(app) as base:
        yield base, proxy


# -- importing ----------------------------------------------------------------------------------


def test_importing_the_sdk_loads_no_server_code_and_no_redis() -> None:
    probe = (
        "import sys, service.client; from service.client import AsyncClient, Client, User, Room; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'aiohttp', 'fakeredis', "
        "'msgspec', 'uvloop') or m.startswith(('service.http', 'service.store', 'service.settings'))); "
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"


def test_the_package_is_marked_typed() -> None:
    assert (ROOT / "service" / "py.typed").is_file()


def test_the_sync_client_mirrors_the_async_client() -> None:
    def api(cls: type) -> dict[str, str]:
        return {
            name: str(inspect.signature(member)).replace("Async", "").replace("Iterator", "Iter")
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")
        }

    sync, asynchronous = api(Client), api(AsyncClient)
    sync["aclose"] = sync.pop("close")
    assert sync == asynchronous


# -- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600), ("30s", 30), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("45", 45), ("1.5m", 90)],
)
def test_durations_read_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_durations_take_numbers_and_timedeltas_and_refuse_nonsense() -> None:
    assert parse_duration(90) == 90
    assert parse_duration(2.5) == 2.5
    assert parse_duration(timedelta(minutes=2)) == 120
    for bad in ("soon", "10x", "", "-5", -1, float("nan"), True):
        with pytest.raises(InvalidArgument):
            parse_duration(bad)


def test_targets_and_options_normalise() -> None:
    assert parse_target("user:alice") == User("alice")
    assert parse_target("room:ops") == Room("ops")
    assert parse_target(Room("ops")) == Room("ops")
    with pytest.raises(InvalidArgument):
        parse_target("alice")
    assert Option.of("deploy") == Option("deploy", "deploy")
    assert Option.of("Yes, deploy now!") == Option("yes-deploy-now", "Yes, deploy now!")
    assert Option.of(("abort", "Abort it")) == Option("abort", "Abort it")


def test_a_client_without_url_or_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QS_URL", raising=False)
    monkeypatch.delenv("QS_TOKEN", raising=False)
    with pytest.raises(InvalidArgument, match="QS_URL"):
        Client(token="t")
    with pytest.raises(InvalidArgument, match="QS_TOKEN"):
        Client("http://127.0.0.1:1")


# -- the round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize("wire", ["msgpack", "json"])
async def test_ask_then_wait_returns_the_answer_and_the_envelope_get_returns(
    live: Live, alice: AsyncClient, wire: Wire
) -> None:
    async with live.client(live.agent, wire=wire) as agent:
        q = await agent.ask(
            "Deploy v2.3?", ["deploy", "abort"], to=User("alice"), timeout="10m", metadata={"build": 7}
        )
        assert q.created
        assert q.envelope.state == "pending"
        assert [o.id for o in q.envelope.options] == ["deploy", "abort"]
        assert (q.envelope.expires_at - q.envelope.created_at).total_seconds() == 600
        waiting = asyncio.create_task(q.wait(timeout=LIMIT))
        outcome = await alice.answer(q.id, "deploy")
        result = await waiting
        fetched = await agent.get(q.id)
    assert outcome.applied
    assert result.state == "answered"
    assert result.answered("deploy")
    assert not result.answered("abort")
    assert result.option == "deploy"
    assert result.answered_by == "alice"
    assert result.resolved_at == fetched.resolved_at
    assert result.envelope == fetched.raw == outcome.question.raw
    assert result.envelope["metadata"] == {"build": 7}


@pytest.mark.parametrize(
    ("wire", "media"), [("msgpack", "application/msgpack"), ("json", "application/json")]
)
async def test_the_wire_is_msgpack_by_default_and_json_on_request(live: Live, wire: Wire, media: str) -> None:
    async with (
        proxy_to(live.url, "", []) as (url, proxy),
        AsyncClient(url, live.agent, wire=wire) as agent,
    ):
        await agent.ask("Which wire?", ["yes", "no"], to=User("alice"), timeout=60)
    assert proxy.media == [(media, media)]


async def test_a_room_question_any_member_answers(live: Live, agent: AsyncClient) -> None:
    q = await agent.ask("Restart ingest?", ["yes", "no"], to=Room("ops"), timeout=60)
    async with live.client(live.bob) as bob:
        assert (await bob.answer(q.id, "no")).applied
    result = await q.wait(timeout=LIMIT)
    assert (result.option, result.answered_by) == ("no", "bob")


async def test_wait_returns_expired_when_nobody_answers(agent: AsyncClient) -> None:
    q = await agent.ask("Anyone?", ["yes", "no"], to="user:alice", timeout=timedelta(seconds=1))
    result = await q.wait(timeout=LIMIT)
    assert result.state == "expired"
    assert result.expired
    assert not result.answered()
    assert result.option is None


async def test_wait_returns_cancelled_with_the_reason(agent: AsyncClient) -> None:
    q = await agent.ask("Rotate keys?", ["yes", "later"], to=User("alice"), timeout="1h")
    waiting = asyncio.create_task(q.wait(timeout=LIMIT))
    outcome = await q.cancel("done elsewhere")
    result = await waiting
    assert outcome.applied
    assert result.state == "cancelled"
    assert (result.cancelled_by, result.cancel_reason) == ("agent", "done elsewhere")
    assert not (await agent.cancel(q.id)).applied


async def test_a_second_answer_is_not_applied_and_keeps_the_first(
    live: Live, agent: AsyncClient, alice: AsyncClient
) -> None:
    q = await agent.ask("Ship?", ["yes", "no"], to=Room("ops"), timeout=60)
    assert (await alice.answer(q.id, "yes")).applied
    async with live.client(live.bob) as bob:
        second = await bob.answer(q.id, "no")
    assert not second.applied
    assert second.question.answer is not None
    assert (second.question.answer.option, second.question.answer.responder) == ("yes", "alice")


async def test_wait_with_a_timeout_raises_wait_timeout_while_pending(live: Live, agent: AsyncClient) -> None:
    q = await agent.ask("Slow?", ["yes", "no"], to=User("alice"), timeout="1h")
    with pytest.raises(WaitTimeout) as caught:
        await q.wait(timeout=0.3)
    assert caught.value.envelope.id == q.id
    assert caught.value.envelope.state == "pending"


# -- errors -------------------------------------------------------------------------------------


async def test_problems_become_typed_exceptions(live: Live, agent: AsyncClient, alice: AsyncClient) -> None:
    with pytest.raises(NotFound) as missing:
        await agent.get("nosuchquestion")
    assert missing.value.status == 404
    assert missing.value.type.endswith("/not-found")
    assert missing.value.slug == "not-found"
    assert missing.value.title == "No such resource"
    assert "nosuchquestion" in missing.value.detail

    with pytest.raises(ValidationFailed) as unknown_user:
        await agent.ask("Hi?", ["yes", "no"], to=User("nobody"), timeout=60)
    assert unknown_user.value.status == 422

    q = await agent.ask("Hi?", ["yes", "no"], to=User("alice"), timeout=60)
    with pytest.raises(Forbidden):
        await agent.answer(q.id, "yes")
    with pytest.raises(ValidationFailed):
        await alice.answer(q.id, "maybe")
    async with live.client("qs_not_a_token") as stranger:
        with pytest.raises(ProblemError) as unauthenticated:
            await stranger.get(q.id)
    assert unauthenticated.value.status == 401


async def test_bad_arguments_fail_before_sending(agent: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match="exactly one"):
        await agent.ask("Hi?", ["yes", "no"], to=User("alice"))
    with pytest.raises(InvalidArgument, match="shorter than one second"):
        await agent.ask("Hi?", ["yes", "no"], to=User("alice"), timeout=0.2)
    with pytest.raises(InvalidArgument, match="list of options"):
        await agent.ask("Hi?", "yes", to=User("alice"), timeout=60)
    with pytest.raises(InvalidArgument, match="timezone"):
        await agent.ask("Hi?", ["yes", "no"], to=User("alice"), expires_at=datetime(2030, 1, 1))
    with pytest.raises(InvalidArgument, match="http"):
        Client("127.0.0.1:8080", "token")


@pytest.mark.parametrize(
    "bad",
    [
        {"options": [("a",), "b"]},
        {"options": [{"label": "x"}, "b"]},
        {"options": [1, 2]},
        {"options": [("Yes!", "Yes"), "no"]},
        {"options": ["only"]},
        {"options": [f"o{n}" for n in range(11)]},
        {"idempotency_key": "\u043a\u043b\u044e\u0447"},
        {"idempotency_key": "a b"},
        {"metadata": {1: "x"}},
        {"metadata": {"runs": [{"attempt": 1}, {2: "y"}]}},
    ],
)
async def test_malformed_options_keys_and_metadata_fail_before_sending(
    agent: AsyncClient, bad: dict[str, Any]
) -> None:
    """Raised as InvalidArgument (a ValueError), as docs/sdk.md says, not as an IndexError,
    KeyError or TypeError, nor sent for the service to refuse."""
    call: dict[str, Any] = {"options": ["yes", "no"]} | bad
    options = call.pop("options")
    with pytest.raises(InvalidArgument):
        await agent.ask("Hi?", options, to=User("alice"), timeout=60, **call)
    assert [q async for q in agent.list()] == []


async def test_ask_takes_an_absolute_deadline(agent: AsyncClient) -> None:
    deadline = (datetime.now(UTC) + timedelta(minutes=5)).replace(microsecond=0)
    q = await agent.ask("By then?", ["yes", "no"], to=User("alice"), expires_at=deadline)
    assert q.envelope.expires_at == deadline


async def test_an_unreachable_service_raises_transport_error_after_the_retries() -> None:
    async with AsyncClient(f"http://127.0.0.1:{free_port()}", "t", retry=Retry(3, 0.01, 0.02)) as client:
        with pytest.raises(TransportError):
            await client.get("whatever")


# -- listing and waiting for many ---------------------------------------------------------------


async def test_list_follows_the_cursor_across_pages(agent: AsyncClient, alice: AsyncClient) -> None:
    asked = [(await agent.ask(f"Q{i}?", ["yes", "no"], to=User("alice"), timeout=60)).id for i in range(5)]
    listed = [q.id async for q in agent.list(page_size=2)]
    assert listed == asked[::-1]
    assert [q.id async for q in agent.list(page_size=2, limit=3)] == asked[::-1][:3]
    await alice.answer(asked[0], "yes")
    pending = [q.id async for q in alice.list(role="responder", state="pending")]
    assert pending == asked[:0:-1]
    page = await agent.list_page(page_size=2)
    assert len(page.items) == 2
    assert page.next_cursor is not None


async def test_wait_many_returns_on_any_or_all(agent: AsyncClient, alice: AsyncClient) -> None:
    first = await agent.ask("A?", ["yes", "no"], to=User("alice"), timeout=60)
    second = await agent.ask("B?", ["yes", "no"], to=User("alice"), timeout=60)
    ids = [first.id, second.id]
    looked = await agent.wait_many(ids, timeout=0)
    assert not looked.condition_met
    waiting_all = asyncio.create_task(agent.wait_many(ids, mode="all", timeout=LIMIT))
    await alice.answer(first.id, "yes")
    any_done = await agent.wait_many(ids, mode="any", timeout=LIMIT)
    assert any_done.condition_met
    assert [q.id for q in any_done.terminal] == [first.id]
    await alice.answer(second.id, "no")
    all_done = await waiting_all
    assert all_done.condition_met
    assert all_done.mode == "all"
    assert [q.state for q in all_done.items] == ["answered", "answered"]


# -- retries ------------------------------------------------------------------------------------


async def test_a_retried_ask_whose_reply_was_lost_creates_one_question(live: Live) -> None:
    async with (
        proxy_to(live.url, r"^/v1/questions$", ["lose"]) as (url, proxy),
        AsyncClient(url, live.agent, retry=FAST) as agent,
    ):
        q = await agent.ask("Deploy?", ["deploy", "abort"], to=User("alice"), timeout="10m")
        mine = [item.id async for item in agent.list()]
    assert proxy.seen[:2] == ["POST /v1/questions lose", "POST /v1/questions forward"]
    assert mine == [q.id]
    assert not q.created  # the second try found the question the first one made


async def test_a_retried_answer_and_cancel_whose_replies_were_lost_report_applied(
    live: Live, alice: AsyncClient
) -> None:
    async with (
        proxy_to(live.url, r"/(answer|cancel)$", ["lose", "forward", "lose"]) as (url, proxy),
        AsyncClient(url, live.agent, retry=FAST) as agent,
        AsyncClient(url, live.alice, retry=FAST) as alice_via_proxy,
    ):
        answered = await agent.ask("Deploy?", ["deploy", "abort"], to=User("alice"), timeout="10m")
        outcome = await alice_via_proxy.answer(answered.id, "deploy")
        cancelled = await agent.ask("Rotate?", ["yes", "no"], to=User("alice"), timeout="10m")
        withdrawn = await cancelled.cancel("not needed")
    assert [s.rsplit(" ", 1)[1] for s in proxy.seen if "/answer" in s] == ["lose", "forward"]
    assert [s.rsplit(" ", 1)[1] for s in proxy.seen if "/cancel" in s] == ["lose", "forward"]
    assert outcome.applied  # the first try answered; the retry is told so, not "someone else"
    assert outcome.question.answer is not None
    assert outcome.question.answer.responder == "alice"
    assert withdrawn.applied
    assert (await alice.get(cancelled.id)).state == "cancelled"


async def test_the_same_idempotency_key_returns_the_same_question(agent: AsyncClient) -> None:
    first = await agent.ask("Once?", ["yes", "no"], to=User("alice"), timeout=60, idempotency_key="k-1")
    again = await agent.ask("Once?", ["yes", "no"], to=User("alice"), timeout=60, idempotency_key="k-1")
    assert (first.created, again.created) == (True, False)
    assert again.id == first.id


async def test_wait_survives_503s_and_dropped_connections(live: Live, alice: AsyncClient) -> None:
    async with (
        proxy_to(live.url, r"/wait$", ["503", "drop", "503", "lose"]) as (url, proxy),
        AsyncClient(url, live.agent, retry=FAST, poll_seconds=1) as agent,
    ):
        q = await agent.ask("Still there?", ["yes", "no"], to=User("alice"), timeout=60)
        waiting = asyncio.create_task(q.wait(timeout=LIMIT))
        await alice.answer(q.id, "yes")
        result = await waiting
    assert result.answered("yes")
    steps = [s.rsplit(" ", 1)[1] for s in proxy.seen if s.endswith(("503", "drop", "lose"))]
    assert steps == ["503", "drop", "503", "lose"]


async def test_a_503_that_lasts_past_the_retries_is_raised_as_unavailable(live: Live) -> None:
    async with (
        proxy_to(live.url, r"^/v1/questions/", ["503"] * 3) as (url, _),
        AsyncClient(url, live.agent, retry=Retry(3, 0.01, 0.02)) as agent,
    ):
        with pytest.raises(Unavailable) as caught:
            await agent.get("anything")
    assert caught.value.status == 503


async def test_a_429_for_parked_waits_is_retried_and_one_for_kept_questions_is_raised_at_once(
    settings: Settings,
) -> None:
    async with serve(settings.replace(questions_per_agent=16)) as live_url:
        live = await populate(live_url)
        async with (
            proxy_to(live.url, r"/wait$", ["429", "429"]) as (url, proxy),
            AsyncClient(url, live.agent, retry=FAST) as agent,
        ):
            q = await agent.ask("Still there?", ["yes", "no"], to=User("alice"), timeout=60)
            async with live.client(live.alice) as alice:
                await alice.answer(q.id, "yes")
            assert (await q.wait(timeout=LIMIT)).answered("yes")  # retried past both 429s
            created, refused = await asks_until_refused(agent, 40)  # 40 asks, 16 places (1 per bucket)
    assert refused.slug == "too-many-questions"
    asks = [s for s in proxy.seen if s.startswith("POST /v1/questions ")]
    statuses = [s for s in proxy.seen if s.endswith(" 429")]
    assert len(statuses) == 2
    assert len(asks) == 1 + created + 1  # the first question, the created, one try of the refused


async def asks_until_refused(agent: AsyncClient, tries: int) -> tuple[int, TooManyRequests]:
    """(questions created, the refusal) of asking until the first refusal."""
    for created in range(tries):
        try:
            await agent.ask("Again?", ["yes", "no"], to=User("alice"), timeout=60)
        except TooManyRequests as refused:
            return created, refused
    raise AssertionError(f"{tries} asks, none refused")


# -- the blocking client ------------------------------------------------------------------------


async def test_the_sync_client_asks_and_waits_like_the_async_one(live: Live, alice: AsyncClient) -> None:
    def ask_and_wait(asked: asyncio.Future[str], loop: asyncio.AbstractEventLoop) -> Any:
        with Client(live.url, live.agent, retry=FAST, wire="json") as agent:
            q = agent.ask("Sync?", ["yes", "no"], to=User("alice"), timeout="5m")
            loop.call_soon_threadsafe(asked.set_result, q.id)
            result = q.wait(timeout=LIMIT)
            listed = [item.id for item in agent.list(page_size=1)]
            return result, listed

    loop = asyncio.get_running_loop()
    asked: asyncio.Future[str] = loop.create_future()
    done = asyncio.ensure_future(asyncio.to_thread(ask_and_wait, asked, loop))
    await asyncio.wait([asked, done], return_when=asyncio.FIRST_COMPLETED)
    if done.done():
        done.result()  # the thread failed before asking: raise its error here
    question_id = asked.result()
    await alice.answer(question_id, "no")
    result, listed = await done
    assert result.answered("no")
    assert listed == [question_id]


# -- the README example -------------------------------------------------------------------------


def readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python SDK", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


async def test_the_readme_sdk_example_runs_against_a_live_service(live: Live, alice: AsyncClient) -> None:
    env = {"QS_URL": live.url, "QS_TOKEN": live.agent, "PATH": "/usr/bin:/bin"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", readme_example(), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    first = (await process.stdout.readline()).decode()
    question_id = first.split()[-1]
    await alice.answer(question_id, "deploy")
    rest, errors = await process.communicate()
    assert process.returncode == 0, errors.decode()
    assert "deploying" in rest.decode()
