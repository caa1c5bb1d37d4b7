"""A small asyncio TCP proxy between the service and Redis that injects faults on cue.

Each client connection gets its own pair of pipes. A rule matches a byte pattern in what the
client sends (a script's SHA, `SUBSCRIBE`, `XACK`, ...) and then does one thing to that
connection:

- LOSE_REPLY: forward the request, wait until Redis starts replying (so the command ran), drop
  the reply and go silent; the client sees a socket timeout.
- RESET_AFTER_REPLY: the same, but close the connection instead; the client sees a reset.
- SWALLOW: drop the request (Redis never sees it) and go silent.
- HOLD_REQUEST: keep the request until `release()`, then forward it.
- HOLD_REPLY: forward the request and keep everything Redis sends back until `release()`.

A rule fires `times` times (None: always). `fired` is set the first time, so a test waits on
that instead of sleeping. `latency` delays every server-to-client chunk on every connection.
Because the proxy sees raw chunks, a pattern split across two reads is missed: every command a
test targets here is small and sent with one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


class Action(enum.Enum):
    LOSE_REPLY = "lose reply"
    RESET_AFTER_REPLY = "reset after reply"
    SWALLOW = "swallow"
    HOLD_REQUEST = "hold request"
    HOLD_REPLY = "hold reply"


@dataclass(eq=False)
class Rule:
    pattern: bytes
    action: Action
    times: int | None = 1
    also: bytes = b""  # a second pattern the same chunk must contain (empty: none)
    hits: int = 0
    fired: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def matches(self, chunk: bytes) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        return self.pattern in chunk and self.also in chunk

    def release(self) -> None:
        self.released.set()


class _Link:
    """One proxied connection: client <-> proxy <-> Redis."""

    def __init__(
        self,
        proxy: Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.server_reader, self.server_writer = server
        self.silent = False  # once set, nothing more goes either way
        self.reply_gate: asyncio.Event | None = None  # set: server bytes may flow
        self.reply_seen = asyncio.Event()
        self.drop_replies = False

    async def run(self) -> None:
        upstream = asyncio.create_task(self._client_to_server())
        downstream = asyncio.create_task(self._server_to_client())
        try:
            await asyncio.wait([upstream, downstream], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (upstream, downstream):
                task.cancel()
            await asyncio.gather(upstream, downstream, return_exceptions=True)
            self.close()

    def close(self) -> None:
        for writer in (self.client_writer, self.server_writer):
            writer.close()

    async def _client_to_server(self) -> None:
        while chunk := await self.client_reader.read(65536):
            if self.silent:
                continue
            rule = self.proxy.match(chunk)
            if rule is None:
                self.server_writer.write(chunk)
                await self.server_writer.drain()
                continue
            await self._apply(rule, chunk)

    async def _apply(self, rule: Rule, chunk: bytes) -> None:
        if rule.action is Action.SWALLOW:
            self.silent = True
            rule.fired.set()
            return
        if rule.action is Action.HOLD_REQUEST:
            rule.fired.set()
            await rule.released.wait()
            self.server_writer.write(chunk)
            await self.server_writer.drain()
            return
        if rule.action is Action.HOLD_REPLY:
            self.reply_gate = rule.released
            self.server_writer.write(chunk)
            await self.server_writer.drain()
            rule.fired.set()
            return
        # LOSE_REPLY / RESET_AFTER_REPLY: the command must run, its reply must not arrive.
        self.drop_replies = True
        self.reply_seen.clear()
        self.server_writer.write(chunk)
        await self.server_writer.drain()
        await self.reply_seen.wait()
        rule.fired.set()
        if rule.action is Action.RESET_AFTER_REPLY:
            raise ConnectionResetError("proxy: reset after the reply")  # ends the link
        self.silent = True

    async def _server_to_client(self) -> None:
        while chunk := await self.server_reader.read(65536):
            if self.proxy.latency:
                await asyncio.sleep(self.proxy.latency)
            if self.drop_replies or self.silent:
                self.reply_seen.set()
                continue
            if self.reply_gate is not None:
                await self.reply_gate.wait()
            self.client_writer.write(chunk)
            await self.client_writer.drain()


class Proxy:
    """Listens on 127.0.0.1:<free port> and forwards every connection to Redis at `port`."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.rules: list[Rule] = []
        self.latency = 0.0
        self.links: set[_Link] = set()
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def add(self, rule: Rule) -> Rule:
        self.rules.append(rule)
        return rule

    def match(self, chunk: bytes) -> Rule | None:
        for rule in self.rules:
            if rule.matches(chunk):
                rule.hits += 1
                return rule
        return None

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        link = _Link(self, (reader, writer), server)
        self.links.add(link)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await link.run()
        except (ConnectionError, OSError):
            pass  # one side went away: the link is closed in run()
        finally:
            self.links.discard(link)
            self._tasks.discard(task)

    def cut_all(self) -> None:
        """Close every proxied connection now (both sides see a reset)."""
        for link in list(self.links):
            link.close()

    async def stop(self) -> None:
        for rule in self.rules:
            rule.release()
        if self._server is not None:
            self._server.close()
        self.cut_all()
        # Not cancelled: asyncio's stream callback would log a cancelled handler as an error.
        # Closing both sides ends every link on its own.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        if self._server is not None:
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def running_proxy(target_port: int) -> AsyncIterator[Proxy]:
    proxy = await Proxy(target_port).start()
    try:
        yield proxy
    finally:
        await proxy.stop()
