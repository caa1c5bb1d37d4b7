"""Browser fixtures: one Chromium and one service per module, shared on the module's event loop
(every test here runs on it: `pytest.mark.asyncio(loop_scope="module")`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from playwright.async_api import Browser, async_playwright

from tests.browser.harness import Service, launch, require_chromium, running_service
from tests.conftest import test_settings
from tests.redis_server import RedisServer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    require_chromium()
    playwright = await async_playwright().start()
    try:
        chromium = await launch(playwright)
        try:
            yield chromium
        finally:
            await chromium.close()
    finally:
        await playwright.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(redis_server: RedisServer) -> AsyncIterator[Service]:
    async with running_service(test_settings(redis_server.url)) as running:
        yield running
