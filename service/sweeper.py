"""Deadlines: the sweeper (the enforcer) and the keyspace-notification listener (a prompt hint).

Both only ever call expire.lua, which decides with Redis TIME and moves a question only while it
is pending, so any number of sweepers and listeners may run at once in any processes.

Keyspace events are per node: on a Redis Cluster each primary reports only the keys it holds.
The listener there subscribes on every primary (redis-py's cluster keyspace notifications), and
follows the client's slot map (which redis-py re-reads on MOVED and connection errors) every
TOPOLOGY_SECONDS and after any error, so a replica promoted by a failover is listened to (and
gets `notify-keyspace-events`) and a demoted primary is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from service.backoff import Backoff, keep_running
from service.keys import Keys
from service.redis_client import as_cluster, is_cluster
from service.scripts import Code
from service.store import QuestionStore

log = logging.getLogger(__name__)
EXPIRED_EVENT = "__keyevent@{db}__:expired"
TOPOLOGY_SECONDS = 5.0


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
        self.failures = 0  # passes that raised (for /metrics)
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
                self.failures += 1
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
        """Make sure `notify-keyspace-events` includes `Ex` (on a cluster: on every node, replicas
        too, so a promoted one reports expiries); warn when a server refuses."""
        try:
            if not is_cluster(self.redis):
                await _enable_expired_events(self.redis, {})
                return True
            cluster = as_cluster(self.redis)
            for node in cluster.get_nodes():
                await _enable_expired_events(cluster, {"target_nodes": node})
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
        if is_cluster(self.redis):
            await self._listen_cluster(as_cluster(self.redis), backoff)
            return
        db = self.redis.connection_pool.connection_kwargs.get("db", 0)
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(EXPIRED_EVENT.format(db=db))
            confirmations = 0
            while not self.stopping:
                try:
                    message = await pubsub.get_message(timeout=1.0)
                except RedisError as exc:
                    await backoff.failed(exc)
                    continue
                backoff.succeeded()
                if message is not None and message["type"] == "subscribe":
                    confirmations += 1
                    if confirmations > 1:
                        # redis-py reconnected and subscribed again: Redis may have restarted,
                        # with notify-keyspace-events back at its configured value (often off).
                        self.enabled = await self.enable_notifications()
                elif message is not None and message["type"] == "message":
                    await self._on_expired(message["data"])
        finally:
            await pubsub.aclose()

    async def _listen_cluster(self, cluster: RedisCluster, backoff: Backoff) -> None:
        """Every primary's expiry events; the topology is re-read on a timer and after errors."""
        notifications = cluster.keyspace_notifications(ignore_subscribe_messages=True)
        loop = asyncio.get_running_loop()
        try:
            await notifications.subscribe(EXPIRED_EVENT.format(db=0))
            next_refresh = loop.time() + TOPOLOGY_SECONDS
            while not self.stopping:
                if loop.time() >= next_refresh:
                    self.enabled = await self.enable_notifications()
                    await notifications.refresh_subscriptions()  # type: ignore[no-untyped-call]
                    next_refresh = loop.time() + TOPOLOGY_SECONDS
                try:
                    notification = await notifications.get_message(timeout=1.0)
                except RedisError as exc:
                    await backoff.failed(exc)
                    continue
                backoff.succeeded()
                if notification is not None and notification.key is not None:
                    await self._on_expired(str(notification.key))
        finally:
            await notifications.aclose()  # type: ignore[no-untyped-call]

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


async def _enable_expired_events(redis: Redis | RedisCluster, target: dict[str, object]) -> None:
    """Add `Ex` to one server's `notify-keyspace-events` unless it already reports expiries."""
    config = await redis.config_get("notify-keyspace-events", **target)
    current = str(config.get("notify-keyspace-events") or "")
    if "E" in current and ("x" in current or "A" in current):
        return
    await redis.config_set("notify-keyspace-events", "".join(sorted(set(current + "Ex"))), **target)
