"""A live service on a real TCP port for the SDK, CLI and MCP tests: the app on a free port,
the people in it, and a feed of the questions created for someone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from aiohttp import web

from service.__main__ import server_options
from service.client import AsyncClient, Retry
from service.http.app import create_app
from service.settings import Settings
from tests.conftest import ADMIN_TOKEN

FAST = Retry(attempts=6, base=0.02, cap=0.1)


@dataclass
class Live:
    url: str
    agent: str = ""
    alice: str = ""
    bob: str = ""

    def client(self, token: str, **options: Any) -> AsyncClient:
        return AsyncClient(self.url, token, **{"retry": FAST, **options})


@asynccontextmanager
async def on_loopback(app: web.Application, **runner_options: Any) -> AsyncIterator[str]:
    """`app` on 127.0.0.1:<a port the kernel picks>; yields its base URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serve(settings: Settings) -> AsyncIterator[str]:
    """The real app, as the service runs it, on loopback; yields its base URL."""
    async with on_loopback(create_app(settings), **server_options(settings)) as url:
        yield url


async def populate(url: str) -> Live:
    """An agent `bot`, users `alice` and `bob`, and room `ops` with both users."""
    live = Live(url)
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=headers) as admin:
        for name, kind in (("agent", "agent"), ("alice", "user"), ("bob", "user")):
            reply = await admin.post("/v1/admin/principals", json={"id": name, "kind": kind})
            assert reply.status_code == 201, reply.text
            setattr(live, name, reply.json()["token"])
        reply = await admin.put("/v1/admin/rooms/ops", json={"members": ["alice", "bob"]})
        assert reply.status_code == 200, reply.text
    return live


@asynccontextmanager
async def new_questions(url: str, token: str) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Subscribe to `token`'s event stream; yields a function returning the id of the next
    question created for that principal (so tests answer without polling)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http,
        http.stream("GET", "/v1/events") as stream,
    ):
        assert stream.status_code == 200
        lines = stream.aiter_lines()

        async def next_created() -> str:
            event = ""
            async for line in lines:
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "question.created":
                    question_id: str = json.loads(line.removeprefix("data: "))["id"]
                    return question_id
            raise AssertionError("the event stream ended")

        yield next_created
