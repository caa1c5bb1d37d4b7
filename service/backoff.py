"""Retry pacing for background loops: one log line when Redis fails, one when it is back."""

from __future__ import annotations

import asyncio
import logging

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
