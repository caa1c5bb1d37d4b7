"""Retry pacing for background loops: one log line when Redis fails, one when it is back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

log = logging.getLogger(__name__)


class Backoff:
    """Delays that double from `base` to `cap` while failures last; logs only streak changes."""

    def __init__(self, name: str, base: float = 0.1, cap: float = 5.0) -> None:
        self.name = name
        self.base = base
        self.cap = cap
        self.failures = 0

    async def failed(self, exc: BaseException) -> None:
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** (self.failures - 1))
        if self.failures == 1:
            if isinstance(exc, RedisError):
                log.warning("%s: Redis failed (%s); retrying with backoff", self.name, exc)
            else:
                log.error("%s failed; retrying with backoff", self.name, exc_info=exc)
        await asyncio.sleep(delay)

    def succeeded(self) -> None:
        if self.failures:
            log.warning("%s: recovered after %d failed attempts", self.name, self.failures)
            self.failures = 0


async def keep_running(
    name: str, body: Callable[[Backoff], Awaitable[None]], stopping: Callable[[], bool]
) -> None:
    """Run `body` again after any failure (logged once per outage, with backoff) until
    `stopping()` or cancellation."""
    backoff = Backoff(name)
    while not stopping():
        try:
            await body(backoff)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await backoff.failed(exc)


async def stop_tasks(tasks: Sequence[asyncio.Task[Any]], grace: float = 3.0) -> None:
    """Cancel background tasks and wait at most `grace` seconds. redis-py can lose a cancellation
    that lands inside a command (redis/redis-py#2028, #2551); each loop also checks a stop flag,
    which ends it within one iteration, and the grace bound keeps shutdown from ever hanging."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        log.warning("background task %s still running %.0f s after cancel", task.get_name(), grace)
