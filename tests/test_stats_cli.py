"""`question-service stats`: the scripts' counters, pending and overdue questions, outbox and event
stream figures, memory, clients and the settings checks, as text or as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from redis.asyncio import Redis

from service.settings import Settings
from service.stats import collect
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.conftest import test_settings as settings_for
from tests.helpers_reliability import ms, sleep_until_redis_ms
from tests.redis_server import RedisServer


def run(settings: Settings, *args: str, program: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QS_REDIS_URL": settings.redis_url, "QS_KEY_PREFIX": settings.key_prefix}
    command = program or [sys.executable, "-m", "service"]
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=60)


async def test_stats_json_counts_what_happened(api: Api, settings: Settings) -> None:
    agent = await api.principal("bot", "agent")
    alice = await api.principal("alice", "user")
    answered, cancelled, _pending = [await api.ask(agent, {"user": "alice"}) for _ in range(3)]
    assert (await api.answer(alice, answered["id"], "yes")).body["applied"] is True
    assert (await api.answer(alice, answered["id"], "no")).body["applied"] is False  # a stale tap
    assert (await api.cancel(agent, cancelled["id"])).body["applied"] is True

    done = run(settings, "stats", "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["counters"] == {"created": 3, "answered": 1, "expired": 0, "cancelled": 1, "stale": 1}
    assert figures["pending"] == 1
    assert sum(figures["deadlines"]["by_bucket"]) == 1
    assert len(figures["deadlines"]["by_bucket"]) == 16
    assert figures["deadlines"]["overdue"] == 0
    assert figures["deadlines"]["oldest_overdue_seconds"] == 0
    assert figures["purge"] == {"scheduled": 2, "due": 0}
    assert figures["outboxes"]["length"] == 5  # three created, one answered, one cancelled
    assert 0 <= figures["outboxes"]["backlog"] <= 5
    assert figures["memory"]["maxmemory_policy"] == "noeviction"
    assert figures["memory"]["used_memory_human"]
    assert figures["connected_clients"] >= 1
    assert figures["checks"]["persistence"]["state"] == "at_risk"  # the test server keeps nothing


async def test_stats_text_through_the_console_script(api: Api, settings: Settings) -> None:
    agent = await api.principal("bot", "agent")
    await api.ask(agent, {"user": "alice"}, expect=422)
    script = Path(sys.executable).with_name("question-service")
    program = [str(script)] if script.exists() else [sys.executable, "-m", "service"]
    done = run(settings, "stats", program=program)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["key", "prefix", settings.key_prefix]
    assert "created 0" in done.stdout
    assert "pending          0" in done.stdout
    assert any(line.startswith("check persistence") for line in lines)


async def test_stats_reports_overdue_questions_and_event_streams(
    redis_server: RedisServer, redis: Redis
) -> None:
    settings = settings_for(redis_server.url, run_sweeper=False, keyspace_notifications=False)
    client = await start_client(settings)
    try:
        api = Api(client, ADMIN_TOKEN)
        agent = await api.principal("bot", "agent")
        await api.principal("alice", "user")
        question = await api.ask(agent, {"user": "alice"}, expires_in=1)
        await sleep_until_redis_ms(redis, ms(question["expires_at"]) + 100)
        figures = await collect(redis, settings)
    finally:
        await close_client(client)
    assert figures["pending"] == 1
    assert figures["deadlines"]["overdue"] == 1
    assert figures["deadlines"]["oldest_overdue_seconds"] >= 0.1
    before = figures["event_streams"]
    for _ in range(2):
        await redis.xadd(f"{settings.key_prefix}:{{p:carol}}:events", {"type": "x", "data": "{}"})
    streams = (await collect(redis, settings))["event_streams"]
    assert streams == {"count": before["count"] + 1, "entries": before["entries"] + 2}


async def test_the_outbox_backlog_counts_delivered_entries_once_when_redis_cannot_tell_the_lag(
    redis: Redis, settings: Settings
) -> None:
    """After an XDEL past the group's position Redis reports no lag; the stream's length then
    bounds the backlog, and the group's pending entries are already in it."""
    from service.keys import Keys
    from service.stats import RELAY_GROUP, outbox_backlog

    outbox = Keys(settings.key_prefix).outbox(0)
    await redis.xgroup_create(outbox, RELAY_GROUP, id="0", mkstream=True)
    ids = [await redis.xadd(outbox, {"n": str(n)}) for n in range(4)]
    await redis.xreadgroup(RELAY_GROUP, "relay", {outbox: ">"}, count=2)  # two delivered, unacked
    await redis.xdel(outbox, ids[3])
    groups = await redis.xinfo_groups(outbox)
    assert groups[0]["lag"] is None
    assert groups[0]["pending"] == 2
    assert (await outbox_backlog(redis, Keys(settings.key_prefix)))[0].backlog == 3
