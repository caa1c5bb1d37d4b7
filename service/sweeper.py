"""Deadlines: the sweeper (the enforcer) and the keyspace-notification listener (a prompt hint).

Both only ever call expire.lua, which decides with Redis TIME and moves a question only while it
is pending, so any number of sweepers and listeners may run at once in any processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from service.backoff import Backoff, keep_running
from service.keys import Keys
from service.scripts import Code
from service.store import QuestionStore

log = logging.getLogger(__name__)
EXPIRED_EVENT = "__keyevent@{db}__:expired"


@dataclass
class SweepTotals:
    expired: int = 0
    purged: int = 0
    passes: int = 0


class Sweeper:
    def __init__(self, store: QuestionStore, interval: float) -> None:
        self.store = store
        self.interval = interval
        self.totals = SweepTotals()
        self.stopping = False  # checked each pass: see backoff.stop_tasks

    async def sweep_once(self) -> SweepTotals:
        """Expire every overdue question and purge every question past retention, in batches."""
        done = SweepTotals(passes=1)
        keys = self.store.keys
        while True:
            now = await self.store.redis_time_ms()
            overdue = await self.store.due(keys.deadlines, now)
            codes = await self.store.expire_many(overdue)
            done.expired += codes.count(Code.APPLIED)
            retired = await self.store.due(keys.purge, now)
            done.purged += await self.store.purge_many(retired)
            if len(overdue) < self.store.sweep_batch and len(retired) < self.store.sweep_batch:
                break
        self.totals.expired += done.expired
        self.totals.purged += done.purged
        self.totals.passes += 1
        return done

    async def run(self) -> None:
        """Sweep on a drift-free schedule until cancelled; log and go on after any other error."""
        next_at = time.monotonic()
        backoff = Backoff("sweeper", base=self.interval)
        while not self.stopping:
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await backoff.failed(exc)
                next_at = time.monotonic()
                continue
            backoff.succeeded()
            next_at += self.interval
            now = time.monotonic()
            if next_at < now:
                next_at = now  # fell behind: do not burst to catch up
            await asyncio.sleep(next_at - now)


class KeyspaceListener:
    """Expires a question as soon as Redis deletes its deadline marker (when Redis tells us)."""

    def __init__(self, redis: Redis, store: QuestionStore, keys: Keys) -> None:
        self.redis = redis
        self.store = store
        self.keys = keys
        self.expired = 0
        self.enabled = False
        self.stopping = False  # checked each read: see backoff.stop_tasks

    async def enable_notifications(self) -> bool:
        """Make sure `notify-keyspace-events` includes `Ex`; warn when the server refuses."""
        try:
            config = await self.redis.config_get("notify-keyspace-events")
            current = str(config.get("notify-keyspace-events") or "")
            if "E" in current and ("x" in current or "A" in current):
                return True
            await self.redis.config_set("notify-keyspace-events", "".join(sorted(set(current + "Ex"))))
            return True
        except ResponseError as exc:
            log.warning(
                "cannot enable keyspace notifications (%s); the sweeper alone enforces deadlines",
                exc,
            )
            return False

    async def run(self) -> None:
        """Listen until cancelled; after any failure, log it and start over."""
        await keep_running("keyspace listener", self._listen, lambda: self.stopping)

    async def _listen(self, backoff: Backoff) -> None:
        self.enabled = await self.enable_notifications()
        db = self.redis.connection_pool.connection_kwargs.get("db", 0)
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(EXPIRED_EVENT.format(db=db))
            while not self.stopping:
                try:
                    message = await pubsub.get_message(timeout=1.0)
                except RedisError as exc:
                    await backoff.failed(exc)
                    continue
                backoff.succeeded()
                if message is not None:
                    await self._on_expired(message["data"])
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _on_expired(self, key: str) -> None:
        question_id = self.keys.question_id_from_marker(key)
        if question_id is None:
            return
        try:
            codes = await self.store.expire_many([question_id])
        except RedisError as exc:
            log.warning("expiry of %s from its keyspace event failed: %s", question_id, exc)
            return
        self.expired += codes.count(Code.APPLIED)
