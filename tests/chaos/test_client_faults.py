"""Client faults against a service subprocess: 10k long polls dropped at once, slow bodies,
oversized headers. The service's own figures come from its Prometheus /metrics (qs_waiters,
qs_waiter_channels, qs_asyncio_tasks) and its RSS from /proc."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import aiohttp

from bench.procs import ADMIN_TOKEN, ServiceProc, status_kib
from tests.chaos.conftest import Processes
from tests.helpers_contract import within
from tests.helpers_reliability import eventually
from tests.redis_server import RedisServer

CLIENTS = 10_000
QUESTIONS = 100
_METRIC = re.compile(r"^(qs_[a-z_]+) ([0-9.e+]+)$", re.MULTILINE)


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as reply:
        assert reply.status == 200
        return {name: float(value) for name, value in _METRIC.findall(await reply.text())}


async def setup(session: aiohttp.ClientSession, base: str) -> tuple[str, list[str]]:
    """An agent token and QUESTIONS questions (to one user) that stay pending for an hour."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    tokens = {}
    for name, kind in (("deploybot", "agent"), ("alice", "user")):
        async with session.post(
            base + "/v1/admin/principals", json={"id": name, "kind": kind}, headers=admin
        ) as reply:
            assert reply.status == 201
            tokens[name] = (await reply.json())["token"]
    agent = {"Authorization": f"Bearer {tokens['deploybot']}"}
    body = {
        "prompt": "Proceed?",
        "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
        "to": {"user": "alice"},
        "expires_in": 3600,
    }
    ids = []
    for _ in range(QUESTIONS):
        async with session.post(base + "/v1/questions", json=body, headers=agent) as reply:
            assert reply.status == 201
            ids.append((await reply.json())["id"])
    return tokens["deploybot"], ids


async def open_long_polls(
    port: int, token: str, ids: Sequence[str], count: int
) -> list[asyncio.StreamWriter]:
    """`count` raw connections, each with one wait request sent and nothing read."""
    writers: list[asyncio.StreamWriter] = []

    async def one(i: int) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        request = (
            f"GET /v1/questions/{ids[i % len(ids)]}/wait?timeout=60 HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n"
        )
        writer.write(request.encode())
        await writer.drain()
        writers.append(writer)

    for start in range(0, count, 500):
        await asyncio.gather(*(one(i) for i in range(start, min(count, start + 500))))
    return writers


async def park_and_drop(
    session: aiohttp.ClientSession, service: ServiceProc, token: str, ids: Sequence[str], idle_tasks: float
) -> tuple[dict[str, float], int, dict[str, float]]:
    """Park CLIENTS long polls, then drop them all at once (RST-like abort). Returns the metrics
    while parked, the RSS (KiB) while parked, and the metrics once everything was released."""
    writers = await open_long_polls(service.port, token, ids, CLIENTS)
    await eventually(
        lambda: _metric_is(session, service.url, "qs_waiters", CLIENTS),
        within=60,
        every=0.2,
        what="10k waiters parked",
    )
    parked = await metrics(session, service.url)
    rss_parked = status_kib(service.pid)
    for writer in writers:
        writer.transport.abort()

    async def released() -> bool:
        now = await metrics(session, service.url)
        return (
            now["qs_waiters"] == 0
            and now["qs_waiter_channels"] == 0
            and now["qs_asyncio_tasks"] <= idle_tasks + TASK_SLACK
        )

    await eventually(released, within=30, every=0.2, what="every waiter and task released")
    return parked, rss_parked, await metrics(session, service.url)


# Tasks that may run at a scrape besides the idle ones: the scrape's own handler, a sweep pass.
TASK_SLACK = 2


async def test_ten_thousand_dropped_long_polls_leave_no_waiter_no_task_and_no_memory_behind(
    own_redis: RedisServer, processes: Processes, fd_limit: int
) -> None:
    """Invariant: 10,000 clients parked in a long poll (on 100 questions) that all disconnect at
    once release every waiter registration, channel and task (qs_waiters and
    qs_waiter_channels back to 0, qs_asyncio_tasks back to its idle count, from /metrics), and
    the service's memory comes back to its level after an identical earlier round: the first
    round's RSS is the allocator's high-water mark (memory CPython and malloc keep for reuse,
    not a leak), so a second round may not raise the peak by more than 10 MiB (1 KiB leaked per
    waiter would) and may not leave more than 40 MiB above the first round's remainder (what is
    left after a drop varies by ~30 MiB with fragmentation; a per-waiter leak adds up in both)."""
    assert fd_limit >= CLIENTS + 1000, f"the open-files limit {fd_limit} is too low (per process)"
    service = ServiceProc(processes.subdir("service"), own_redis.url)
    await processes.start_async(service)
    assert isinstance(service, ServiceProc)
    async with aiohttp.ClientSession() as session:
        token, ids = await setup(session, service.url)
        idle = await metrics(session, service.url)
        rss_start = status_kib(service.pid)
        _, rss_first_peak, _ = await park_and_drop(session, service, token, ids, idle["qs_asyncio_tasks"])
        rss_baseline = status_kib(service.pid)
        parked, rss_peak, after = await park_and_drop(session, service, token, ids, idle["qs_asyncio_tasks"])
        rss_after = status_kib(service.pid)
    assert parked["qs_waiter_channels"] == QUESTIONS
    assert parked["qs_asyncio_tasks"] >= CLIENTS  # one handler task per parked request
    print(
        f"\nfault 8: RSS at start {rss_start / 1024:.1f} MiB; round 1 peak {rss_first_peak / 1024:.1f}, "
        f"after {rss_baseline / 1024:.1f}; round 2 peak {rss_peak / 1024:.1f}, after "
        f"{rss_after / 1024:.1f} MiB. Tasks idle {idle['qs_asyncio_tasks']:.0f}, "
        f"parked {parked['qs_asyncio_tasks']:.0f}, after {after['qs_asyncio_tasks']:.0f}"
    )
    figures = (rss_start, rss_first_peak, rss_baseline, rss_peak, rss_after)
    assert rss_peak - rss_first_peak < 10 * 1024, figures
    assert rss_after - rss_baseline < 40 * 1024, figures


async def _metric_is(session: aiohttp.ClientSession, base: str, name: str, value: float) -> bool:
    return (await metrics(session, base))[name] == value


async def test_oversized_headers_and_slow_bodies_do_not_tie_up_the_service(
    own_redis: RedisServer, processes: Processes
) -> None:
    """Invariant: a request with an oversized header gets a 4xx or a closed connection; 200
    connections trickling a body one byte at a time do not stop other requests from being
    served meanwhile, and once they go away no task or waiter is left behind."""
    service = ServiceProc(processes.subdir("service"), own_redis.url)
    await processes.start_async(service)
    assert isinstance(service, ServiceProc)
    async with aiohttp.ClientSession() as session:
        token, ids = await setup(session, service.url)
        idle = await metrics(session, service.url)

        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        huge = "x" * 70_000
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Huge: {huge}\r\n\r\n".encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert status_line == b"" or re.match(rb"HTTP/1\.[01] 4\d\d ", status_line), status_line

        slow = []
        for i in range(200):
            _, w = await asyncio.open_connection("127.0.0.1", service.port)
            w.write(
                (
                    f"POST /v1/questions/{ids[i % len(ids)]}/cancel HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: 1000\r\n\r\n{{"
                ).encode()
            )
            slow.append(w)
        for _ in range(3):
            for w in slow:
                w.write(b" ")
            async with session.get(
                f"{service.url}/v1/questions/{ids[0]}", headers={"Authorization": f"Bearer {token}"}
            ) as reply:
                assert reply.status == 200
                assert (await reply.json())["state"] == "pending"
            await asyncio.sleep(0.5)
        for w in slow:
            w.transport.abort()

        async def settled() -> bool:
            now = await metrics(session, service.url)
            return now["qs_asyncio_tasks"] <= idle["qs_asyncio_tasks"] + TASK_SLACK and now["qs_waiters"] == 0

        await eventually(settled, within=20, every=0.2, what="the slow requests released")


async def test_a_body_trickled_one_byte_at_a_time_is_cut_off_with_a_408_in_bounded_time(
    own_redis: RedisServer, processes: Processes
) -> None:
    """Invariant: a request whose body arrives one byte every 0.2 s (slowloris on the body) gets a
    408 problem (or a closed connection) once QS_BODY_TIMEOUT_SECONDS (1 s here) has passed,
    instead of holding its handler for as long as the client likes; the question is untouched."""
    service = ServiceProc(processes.subdir("service"), own_redis.url, body_timeout_seconds="1")
    await processes.start_async(service)
    assert isinstance(service, ServiceProc)
    async with aiohttp.ClientSession() as session:
        token, ids = await setup(session, service.url)
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        writer.write(
            (
                f"POST /v1/questions/{ids[0]}/cancel HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: 1000\r\n\r\n{{"
            ).encode()
        )
        reply = asyncio.create_task(reader.read(65536))
        try:
            for _ in range(100):  # 20 s of trickle at most; the guard below fails first
                done, _ = await asyncio.wait([reply], timeout=0.2)
                if done:
                    break
                writer.write(b" ")
                await writer.drain()
            head = await within(1, reply, "the reply to the trickled body")
        finally:
            writer.transport.abort()
        assert head == b"" or re.match(rb"HTTP/1\.1 408 ", head), head
        async with session.get(
            f"{service.url}/v1/questions/{ids[0]}", headers={"Authorization": f"Bearer {token}"}
        ) as fetched:
            assert (await fetched.json())["state"] == "pending"
