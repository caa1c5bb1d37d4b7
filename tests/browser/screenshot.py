"""Renders docs/inbox.png: the inbox of a user with two questions waiting and some history.

    .venv/bin/python -m tests.browser.screenshot [--out docs/inbox.png]

Starts its own redis-server on a free port and the service in this process; stops both after.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from playwright.async_api import Browser, ViewportSize, async_playwright, expect

from tests.browser.harness import CHROMIUM, MISSING, Service, launch, open_inbox, running_service
from tests.conftest import test_settings
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
VIEWPORT = ViewportSize(width=420, height=900)


async def seed(service: Service) -> str:
    """Alice's inbox as the README shows it; returns her token."""
    api = service.api
    deploybot = await api.principal("deploybot", "agent")
    backupbot = await api.principal("backupbot", "agent")
    alice = await api.principal("alice", "user")
    bob = await api.principal("bob", "user")
    await api.room("oncall", ["alice", "bob"])
    oncall, me = {"room": "oncall"}, {"user": "alice"}

    expired = await service.ask(backupbot, me, "Keep last night's snapshot?", ["Keep", "Drop"], 1)
    answered = await service.ask(deploybot, oncall, "Restart the ingest workers?", ["Yes", "No"])
    await api.answer(bob, answered["id"], "yes")
    cancelled = await service.ask(deploybot, me, "Run the schema migration now?", ["Run", "Postpone"])
    await api.cancel(deploybot, cancelled["id"], "rolled back upstream")
    mine = await service.ask(backupbot, me, "Rotate the backup keys tonight?", ["Rotate", "Later"])
    await api.answer(alice, mine["id"], "rotate")
    await service.ask(deploybot, me, "Merge hotfix 88 into release?", ["Merge", "Hold", "Skip"], 3600)
    await service.ask(deploybot, oncall, "Deploy build 1432 to production?", ["Deploy", "Abort"], 300)
    await api.wait(alice, expired["id"], timeout=10)  # the sweeper expires it within a second
    return alice


async def render(browser: Browser, service: Service, token: str, out: Path) -> None:
    async with open_inbox(browser, service.base_url, token, viewport=VIEWPORT) as inbox:
        await expect(inbox.page.locator("#waiting .cell")).to_have_count(2)
        await expect(inbox.page.locator("#history .cell")).to_have_count(4)
        await inbox.page.screenshot(path=str(out), full_page=True)


async def main(out: Path) -> None:
    if not CHROMIUM.exists():
        raise SystemExit(MISSING)
    redis = RedisServer().start()
    try:
        async with running_service(test_settings(redis.url)) as service, async_playwright() as pw:
            token = await seed(service)
            browser = await launch(pw)
            try:
                await render(browser, service, token, out)
            finally:
                await browser.close()
    finally:
        redis.cleanup()
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "inbox.png")
    asyncio.run(main(parser.parse_args().out))
