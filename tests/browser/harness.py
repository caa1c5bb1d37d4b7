"""What the browser tests and the screenshot script share: Debian's Chromium driven by Playwright,
the service on a real TCP port, and an inbox page that fails on any console error.

The browser is the one at /usr/bin/chromium (Debian's package); nothing is ever downloaded.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient
from playwright.async_api import (
    Browser,
    ConsoleMessage,
    Error,
    Locator,
    Page,
    Playwright,
    ViewportSize,
    expect,
)

from service.settings import Settings
from tests.api import Api
from tests.conftest import ADMIN_TOKEN, close_client, start_client
from tests.redis_server import require_tool

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MISSING = f"Debian's Chromium is not at {CHROMIUM} (Debian: apt-get install chromium)"
PHONE = ViewportSize(width=360, height=740)


def require_chromium() -> None:
    """A skip with the reason when Chromium is missing, or a failure under CI=true."""
    require_tool(str(CHROMIUM) if CHROMIUM.exists() else None, MISSING)


async def launch(playwright: Playwright) -> Browser:
    return await playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)


def unique(name: str) -> str:
    """A principal or room id no other test of this run uses."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


@dataclass
class Service:
    """The service in this process, listening on a free 127.0.0.1 port the browser can reach."""

    client: TestClient[object, object]
    settings: Settings
    api: Api = field(init=False)

    def __post_init__(self) -> None:
        self.api = Api(self.client, ADMIN_TOKEN)

    @property
    def base_url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    async def principal(self, name: str, kind: str) -> tuple[str, str]:
        """A new principal with a unique id: (id, token)."""
        principal_id = unique(name)
        return principal_id, await self.api.principal(principal_id, kind)

    async def ask(
        self, agent: str, to: dict[str, str], prompt: str, labels: list[str], expires_in: int = 600
    ) -> dict[str, Any]:
        options = [{"id": label.lower().replace(" ", "-")[:32], "label": label} for label in labels]
        body = {"prompt": prompt, "options": options, "to": to, "expires_in": expires_in}
        reply = await self.api.call("POST", "/v1/questions", agent, body)
        assert reply.status == 201, reply.body
        question: dict[str, Any] = reply.body
        return question


@asynccontextmanager
async def running_service(settings: Settings) -> AsyncIterator[Service]:
    client = await start_client(settings)
    try:
        yield Service(client, settings)
    finally:
        await close_client(client)


@dataclass
class Inbox:
    """One signed-in inbox page, and everything it logged that a user would call broken."""

    page: Page
    problems: list[str]
    # Console lines a test provoked on purpose (Chromium logs every 4xx reply of a fetch).
    expected: list[str] = field(default_factory=list)

    def cell(self, question_id: str) -> Locator:
        return self.page.locator(f'li.cell[data-id="{question_id}"]')

    def story(self, question_id: str) -> Locator:
        return self.cell(question_id).locator(".story")

    def option(self, question_id: str, label: str) -> Locator:
        return self.cell(question_id).get_by_role("button", name=label, exact=True)


@asynccontextmanager
async def open_inbox(
    browser: Browser,
    base_url: str,
    token: str | None,
    viewport: ViewportSize | None = None,
    fragment: str = "",
) -> AsyncIterator[Inbox]:
    """A fresh browser context on the inbox, signed in through a sign-in link when `token` is
    given and live (the event stream open) before the caller goes on. `fragment` is added to
    the link's fragment (`question=<id>`)."""
    context = await browser.new_context(viewport=viewport or ViewportSize(width=800, height=900))
    try:
        page = await context.new_page()
        inbox = Inbox(page, [])
        page.on("console", lambda message: record_console(inbox, message))
        page.on("pageerror", lambda error: record_error(inbox, error))
        parts = [f"token={token}"] if token else []
        await page.goto(f"{base_url}/#" + "&".join([*parts, fragment] if fragment else parts))
        if token:
            await expect(page.locator("#live")).to_have_attribute("data-live", "true")
        yield inbox
        assert inbox.problems == [], f"the page logged errors: {inbox.problems}"
    finally:
        await context.close()


def record_console(inbox: Inbox, message: ConsoleMessage) -> None:
    if any(part in message.text for part in inbox.expected):
        return
    if message.type in ("error", "warning"):
        inbox.problems.append(f"console {message.type}: {message.text}")


def record_error(inbox: Inbox, error: Error) -> None:
    inbox.problems.append(f"page error: {error}")
