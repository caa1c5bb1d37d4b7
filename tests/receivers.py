"""A recording HTTP receiver on 127.0.0.1 for the delivery tests: it stands in for webhook
endpoints, ntfy servers, push services and relays, records every request, and lets a test
decide each reply."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from tests.redis_server import free_port


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RecordingReceiver:
    """Records every request. `reply(n)` (n: requests so far) decides each answer when set; else
    the status is `status_of(path)` (200 unless a test says otherwise)."""

    base: str = ""
    hits: list[Hit] = field(default_factory=list)
    reply: Callable[[int], Awaitable[web.Response]] | None = None
    status_of: Callable[[str], int] = lambda path: 200
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        """The endpoint the webhook tests register."""
        return f"{self.base}/hook"

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(Hit(request.path, dict(request.headers), await request.read()))
        self.arrived.set()
        if self.reply is not None:
            return await self.reply(len(self.hits))
        return web.Response(status=self.status_of(request.path))

    async def at(self, path: str | None, count: int, within: float = 15.0) -> list[Hit]:
        """The first `count` or more requests to `path` (any path: None), once they arrived."""

        async def reached() -> list[Hit]:
            while True:
                found = [h for h in self.hits if path is None or h.path == path]
                if len(found) >= count:
                    return found
                self.arrived.clear()
                await self.arrived.wait()

        return await asyncio.wait_for(reached(), within)


@contextlib.asynccontextmanager
async def recording_receiver(
    status_of: Callable[[str], int] | None = None,
) -> AsyncIterator[RecordingReceiver]:
    receiver = RecordingReceiver()
    if status_of is not None:
        receiver.status_of = status_of
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", receiver.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    receiver.base = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        await runner.cleanup()
