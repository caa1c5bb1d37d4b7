"""/metrics: Prometheus text from a per-app registry, on the main port and optionally on its own;
transitions, waiters, expiries by mechanism, Redis-wide gauges and Redis errors move as they should."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from service.http.appkeys import QUESTIONS, RELAY, SWEEPER
from service.keys import Keys
from service.settings import MEMORY_URL
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import eventually, ms, sleep_until_redis_ms
from tests.redis_server import RedisServer, free_port

# Every name other helpers (alerts, dashboard, fault tests) rely on.
NAMED = {
    "qs_http_requests_total": "counter",
    "qs_http_request_duration_seconds": "histogram",
    "qs_transitions_total": "counter",
    "qs_waiters": "gauge",
    "qs_waiter_channels": "gauge",
    "qs_sse_streams": "gauge",
    "qs_cache_entries": "gauge",
    "qs_asyncio_tasks": "gauge",
    "qs_wake_latency_seconds": "histogram",
    "qs_redis_call_duration_seconds": "histogram",
    "qs_redis_errors_total": "counter",
    "qs_pubsub_reconnects_total": "counter",
    "qs_sweeper_runs_total": "counter",
    "qs_expired_total": "counter",
    "qs_oldest_overdue_pending_seconds": "gauge",
    "qs_outbox_backlog": "gauge",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


async def scrape(client: TestClient[object, object]) -> Samples:
    reply = await client.get("/metrics")
    assert reply.status == 200
    return parse(await reply.text())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
async def quiet(redis_server: RedisServer) -> AsyncIterator[tuple[TestClient[object, object], Api]]:
    """An app whose deadlines move only when the test says so (no sweeper, no listener)."""
    client = await start_client(
        settings_for(redis_server.url, run_sweeper=False, keyspace_notifications=False)
    )
    yield client, Api(client, ADMIN_TOKEN)
    await close_client(client)


async def people(api: Api) -> tuple[str, str]:
    return await api.principal("bot", "agent"), await api.principal("alice", "user")


async def test_metrics_serves_prometheus_text_with_every_named_metric(api: Api) -> None:
    reply = await api.client.get("/metrics")
    assert reply.status == 200
    assert reply.content_type == "text/plain"
    text = await reply.text()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in NAMED.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert types.get(family) == kind, f"{name} is not served as a {kind}"


async def test_an_answer_adds_one_applied_answered_transition(api: Api) -> None:
    agent, alice = await people(api)
    question = await api.ask(agent, {"user": "alice"})
    before = await scrape(api.client)
    assert (await api.answer(alice, question["id"], "yes")).body["applied"] is True
    assert (await api.answer(alice, question["id"], "no")).body["applied"] is False
    after = await scrape(api.client)
    for result, added in (("applied", 1), ("stale", 1)):
        name, labels = "qs_transitions_total", {"kind": "answered", "result": result}
        assert value(after, name, **labels) - value(before, name, **labels) == added
    assert value(after, "qs_transitions_total", kind="created", result="applied") >= 1


async def test_an_answer_sent_again_with_its_key_counts_as_replayed_not_as_a_second_applied(api: Api) -> None:
    agent, alice = await people(api)
    question = await api.ask(agent, {"user": "alice"})
    path, key = f"/v1/questions/{question['id']}/answer", {"Idempotency-Key": "tap-7"}
    before = await scrape(api.client)
    for _ in range(3):
        reply = await api.call("POST", path, alice, {"option": "yes"}, headers=key)
        assert reply.body["applied"] is True
    after = await scrape(api.client)
    for result, added in (("applied", 1), ("replayed", 2), ("stale", 0)):
        name, labels = "qs_transitions_total", {"kind": "answered", "result": result}
        assert value(after, name, **labels) - value(before, name, **labels) == added, result


async def test_a_room_answer_in_a_process_that_never_saw_the_question_counts_one_applied_answer(
    api: Api,
) -> None:
    """Such a process first calls the script without the responder's rooms; that call only
    learns the question's room and must not count as a refused (not_eligible) answer."""
    agent, _ = await people(api)
    bob = await api.principal("bob", "user")
    await api.room("ops", ["bob"])
    question = await api.ask(agent, {"room": "ops"})
    api.client.app[QUESTIONS].targets.drop(question["id"])  # type: ignore[index]
    before = await scrape(api.client)
    assert (await api.answer(bob, question["id"], "yes")).body["applied"] is True
    after = await scrape(api.client)
    for result, added in (("applied", 1), ("not_eligible", 0)):
        name, labels = "qs_transitions_total", {"kind": "answered", "result": result}
        assert value(after, name, **labels) - value(before, name, **labels) == added, result


async def test_cache_entries_count_each_question_the_process_remembers(api: Api) -> None:
    agent, alice = await people(api)
    before = await scrape(api.client)
    questions = [await api.ask(agent, {"user": "alice"}) for _ in range(3)]
    await api.answer(alice, questions[0]["id"], "yes")
    after = await scrape(api.client)

    added = value(after, "qs_cache_entries", cache="question_targets") - value(
        before, "qs_cache_entries", cache="question_targets"
    )
    assert added == 3
    assert {"tokens", "principals", "room_members"} <= {
        dict(labels)["cache"] for name, labels in after if name == "qs_cache_entries"
    }


async def test_only_a_users_reads_fill_the_target_cache_not_an_askers_fetches_and_waits(api: Api) -> None:
    """The cache saves an answerer a script call; an asker's long polls must not fill it (every
    parked waiter would hold an entry)."""
    agent, alice = await people(api)
    question = await api.ask(agent, {"user": "alice"})
    targets = api.client.server.app[QUESTIONS].targets
    targets.drop(question["id"])  # as if another process had created it

    await api.get(agent, question["id"])
    await api.wait(agent, question["id"], 0.1)
    assert targets.get(question["id"]) is None
    await api.get(alice, question["id"])
    assert targets.get(question["id"]) is not None


async def test_http_requests_are_labelled_by_route_template_never_by_raw_path(api: Api) -> None:
    agent, _ = await people(api)
    question = await api.ask(agent, {"user": "alice"})
    assert (await api.get(agent, question["id"])).status == 200
    assert (await api.call("GET", "/no/such/path")).status == 404
    assert (await api.call("PATCH", f"/v1/questions/{question['id']}", agent)).status == 405
    reply = await api.client.get("/metrics")
    text = await reply.text()
    samples = parse(text)
    route = {"route": "/v1/questions/{id}", "method": "GET", "status": "200"}
    assert value(samples, "qs_http_requests_total", **route) == 1
    assert value(samples, "qs_http_requests_total", route="unmatched", method="GET", status="404") == 1
    wrong_method = {"route": "/v1/questions/{id}", "method": "PATCH", "status": "405"}
    assert value(samples, "qs_http_requests_total", **wrong_method) == 1
    assert (
        value(samples, "qs_http_request_duration_seconds_count", route="/v1/questions/{id}", method="GET")
        == 1
    )
    assert question["id"] not in text
    assert "/no/such/path" not in text


async def test_a_long_poll_in_flight_shows_one_waiter_then_none(api: Api) -> None:
    agent, alice = await people(api)
    question = await api.ask(agent, {"user": "alice"})
    assert value(await scrape(api.client), "qs_waiters") == 0
    waiting = asyncio.create_task(api.wait(agent, question["id"], 10))

    async def parked() -> bool:
        samples = await scrape(api.client)
        return value(samples, "qs_waiters") == 1 and value(samples, "qs_waiter_channels") == 1

    await eventually(parked, within=5, what="the waiter shows in qs_waiters")
    await api.answer(alice, question["id"], "yes")
    assert (await waiting).body["state"] == "answered"
    samples = await scrape(api.client)
    assert value(samples, "qs_waiters") == 0
    assert value(samples, "qs_wake_latency_seconds_count") == 1
    assert value(samples, "qs_asyncio_tasks") > 0


async def test_an_open_event_stream_shows_in_the_sse_gauge(api: Api) -> None:
    agent, _ = await people(api)
    async with api.client.get("/v1/events", headers={"Authorization": f"Bearer {agent}"}) as stream:
        assert stream.status == 200
        assert stream.headers["X-Request-Id"]

        async def open_stream() -> bool:
            return value(await scrape(api.client), "qs_sse_streams") == 1

        await eventually(open_stream, within=5, what="the stream shows in qs_sse_streams")


async def test_a_sweep_expiring_three_overdue_questions_adds_three_sweep_expiries(
    quiet: tuple[TestClient[object, object], Api], redis_server: RedisServer
) -> None:
    client, api = quiet
    agent, _ = await people(api)
    questions = [await api.ask(agent, {"user": "alice"}, expires_in=1) for _ in range(3)]
    before = await scrape(client)
    assert value(before, "qs_oldest_overdue_pending_seconds") == 0
    latest = max(ms(q["expires_at"]) for q in questions)
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await sleep_until_redis_ms(redis, latest + 50)
    finally:
        await redis.aclose()
    overdue = await scrape(client)
    assert value(overdue, "qs_oldest_overdue_pending_seconds") > 0
    assert value(overdue, "qs_pending_questions") == 3

    assert (await client.server.app[SWEEPER].sweep_once()).expired == 3
    after = await scrape(client)
    assert (
        value(after, "qs_expired_total", mechanism="sweep")
        - value(before, "qs_expired_total", mechanism="sweep")
        == 3
    )
    assert value(after, "qs_sweeper_runs_total") - value(before, "qs_sweeper_runs_total") == 1
    expired = {"kind": "expired", "result": "applied"}
    assert (
        value(after, "qs_transitions_total", **expired) - value(before, "qs_transitions_total", **expired)
        == 3
    )
    assert value(after, "qs_oldest_overdue_pending_seconds") == 0
    assert value(after, "qs_pending_questions") == 0


async def test_a_fetch_or_a_tap_after_the_deadline_counts_one_inline_expiry_each(
    quiet: tuple[TestClient[object, object], Api], redis_server: RedisServer
) -> None:
    client, api = quiet
    agent, alice = await people(api)
    fetched = await api.ask(agent, {"user": "alice"}, expires_in=1)
    tapped = await api.ask(agent, {"user": "alice"}, expires_in=1)
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await sleep_until_redis_ms(redis, ms(tapped["expires_at"]) + 50)
    finally:
        await redis.aclose()
    assert (await api.get(agent, fetched["id"])).body["state"] == "expired"
    assert (await api.get(agent, fetched["id"])).body["state"] == "expired"
    late = await api.answer(alice, tapped["id"], "yes")
    assert late.body["question"]["state"] == "expired"
    assert (await api.answer(alice, tapped["id"], "no")).body["question"]["state"] == "expired"
    samples = await scrape(client)
    assert value(samples, "qs_expired_total", mechanism="inline") == 2  # the first fetch, the first tap
    assert value(samples, "qs_expired_total", mechanism="sweep") == 0
    assert value(samples, "qs_transitions_total", kind="expired", result="applied") == 2
    assert value(samples, "qs_transitions_total", kind="answered", result="stale") == 2


async def test_outbox_backlog_counts_entries_until_the_relay_acknowledges_them(
    redis_server: RedisServer,
) -> None:
    client = await start_client(settings_for(redis_server.url, run_event_relay=False))
    try:
        api = Api(client, ADMIN_TOKEN)
        agent, _ = await people(api)
        await api.ask(agent, {"user": "alice"})
        await api.ask(agent, {"user": "alice"})
        assert value(await scrape(client), "qs_outbox_backlog") == 2
        relay = client.server.app[RELAY]
        running = asyncio.create_task(relay.run())

        async def drained() -> bool:
            return value(await scrape(client), "qs_outbox_backlog") == 0

        try:
            await eventually(drained, within=10, what="the relay drains the outbox")
        finally:
            relay.stopping = True
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        assert value(await scrape(client), "qs_events_relayed_total") == 2
    finally:
        await close_client(client)


async def test_an_outbox_entry_no_consumer_can_process_is_counted_skipped_and_acknowledged_by_both_groups(
    redis_server: RedisServer, redis: Redis
) -> None:
    settings = settings_for(redis_server.url)
    client = await start_client(settings)
    try:
        outbox = Keys(settings.key_prefix).outbox(3)
        await redis.xadd(outbox, {"type": "question.answered", "id": "not-a-question"})

        async def skipped_by_both() -> bool:
            samples = await scrape(client)
            counts = [value(samples, "qs_outbox_skipped_total", group=g) for g in ("events", "webhooks")]
            return counts == [1, 1]

        await eventually(skipped_by_both, within=10, what="both groups skip the entry")
        for group in ("events", "webhooks"):
            assert (await redis.xpending(outbox, group))["pending"] == 0
    finally:
        await close_client(client)


async def test_metrics_are_also_served_on_their_own_port(redis_server: RedisServer) -> None:
    port = free_port()
    client = await start_client(settings_for(redis_server.url, metrics_port=port))
    try:
        assert (await client.get("/healthz")).status == 200
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as reply,
        ):
            assert reply.status == 200
            samples = parse(await reply.text())
        healthz = {"route": "/healthz", "method": "GET", "status": "200"}
        assert value(samples, "qs_http_requests_total", **healthz) == 1
    finally:
        await close_client(client)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{port}/metrics")


async def test_redis_errors_are_counted_and_metrics_still_answer_while_redis_is_down() -> None:
    server = RedisServer().start()
    client = await start_client(settings_for(server.url, redis_timeout_seconds=1))
    try:
        api = Api(client, ADMIN_TOKEN)
        agent, _ = await people(api)
        question = await api.ask(agent, {"user": "alice"})
        assert value(await scrape(client), "qs_redis_scrape_ok") == 1
        server.kill()
        reply = await api.get(ADMIN_TOKEN, question["id"])
        assert reply.status == 503
        samples = await scrape(client)
        assert value(samples, "qs_redis_errors_total", script="expire", kind="connection") >= 1
        assert value(samples, "qs_redis_scrape_ok") == 0
        assert value(samples, "qs_redis_errors_total", script="scrape", kind="connection") >= 1
        assert (
            value(samples, "qs_http_requests_total", route="/v1/questions/{id}", method="GET", status="503")
            == 1
        )
    finally:
        await close_client(client)
        server.cleanup()


async def test_two_apps_in_one_process_keep_separate_figures(redis_server: RedisServer) -> None:
    first = await start_client(settings_for(redis_server.url))
    second = await start_client(settings_for(redis_server.url))
    try:
        await first.get("/healthz")
        await first.get("/healthz")
        healthz = {"route": "/healthz", "method": "GET", "status": "200"}
        assert value(await scrape(first), "qs_http_requests_total", **healthz) == 2
        assert value(await scrape(second), "qs_http_requests_total", **healthz) == 0
    finally:
        await close_client(first)
        await close_client(second)


async def test_metrics_work_on_the_in_memory_backend() -> None:
    client = await start_client(settings_for(MEMORY_URL))
    try:
        api = Api(client, ADMIN_TOKEN)
        agent, alice = await people(api)
        question = await api.ask(agent, {"user": "alice"})
        await api.answer(alice, question["id"], "yes")
        samples = await scrape(client)
        assert value(samples, "qs_transitions_total", kind="answered", result="applied") == 1
        assert value(samples, "qs_pending_questions") == 0
    finally:
        await close_client(client)


async def test_a_killed_pubsub_connection_counts_a_reconnect(api: Api, redis: Redis) -> None:
    agent, alice = await people(api)
    question = await api.ask(agent, {"user": "alice"})
    waiting = asyncio.create_task(api.wait(agent, question["id"], 10))

    async def parked() -> bool:
        return value(await scrape(api.client), "qs_waiters") == 1

    await eventually(parked, within=5, what="the waiter is parked")
    assert value(await scrape(api.client), "qs_pubsub_reconnects_total") == 0
    assert await redis.client_kill_filter(_type="pubsub") >= 1

    async def reconnected() -> bool:
        return value(await scrape(api.client), "qs_pubsub_reconnects_total") >= 1

    await eventually(reconnected, within=10, what="the pub/sub connection comes back")
    await api.answer(alice, question["id"], "yes")
    assert (await waiting).body["state"] == "answered"


@pytest.mark.redis
async def test_a_worker_serves_its_sweeper_and_delivery_metrics_on_the_metrics_port(
    redis_server: RedisServer,
) -> None:
    """`worker` has no HTTP API, so QS_METRICS_PORT is where its sweeps and deliveries show; it
    may be QS_PORT's number, which only `serve` listens on (a worker container's 8080)."""
    import os
    import sys

    port = free_port()
    env = {
        **os.environ,
        "QS_REDIS_URL": redis_server.url,
        "QS_KEY_PREFIX": settings_for(redis_server.url).key_prefix,
        "QS_METRICS_PORT": str(port),
        "QS_PORT": str(port),
        "QS_SWEEP_INTERVAL_SECONDS": "0.1",
    }
    worker = await asyncio.create_subprocess_exec(sys.executable, "-m", "service", "worker", env=env)
    try:
        async with aiohttp.ClientSession() as session:

            async def sweeps_counted() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as reply:
                        text = await reply.text()
                except aiohttp.ClientError:
                    return False
                values = {
                    sample.name: sample.value
                    for family in text_string_to_metric_families(text)
                    for sample in family.samples
                }
                return values.get("qs_sweeper_runs_total", 0) >= 3 and "qs_delivery_attempts_total" in values

            await eventually(sweeps_counted, within=20, what="worker metrics with sweeps")
    finally:
        worker.kill()
        await worker.wait()


def test_serve_refuses_a_metrics_port_that_is_its_own_port() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "QS_PORT": "18080", "QS_METRICS_PORT": "18080"}
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "error: QS_METRICS_PORT must be 0 or a TCP port other than QS_PORT"
