"""create_app(settings): the aiohttp application with its Redis, pub/sub and background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from redis.exceptions import RedisError

from service.auth import Directory
from service.backoff import stop_tasks
from service.coalesce import Durability
from service.delivery import DeliveryWorkers
from service.events import EventHub, EventRelay
from service.http.appkeys import (
    ACTIONS,
    BLOCKING_REDIS,
    DELIVERIES,
    DELIVERY_WORKERS,
    DIRECTORY,
    EVENT_HUB,
    LISTENER,
    METRICS,
    QUESTIONS,
    REDIS,
    RELAY,
    SCRIPTS,
    SETTINGS,
    STORE,
    SWEEPER,
    WAITERS,
    WEBHOOKS,
)
from service.http.problems import STORE_DOWN, problem_middleware
from service.http.routes import PRINCIPAL, ROUTES, auth_middleware
from service.keys import Keys
from service.logs import request_middleware
from service.metrics import Metrics, start_metrics_site
from service.model import RENDERED
from service.pings import Actions
from service.questions import QuestionService
from service.redis_client import connect, connect_blocking
from service.scripts import Scripts
from service.settings import Settings
from service.stats import CheckState, redis_checks
from service.store import QuestionStore
from service.sweeper import KeyspaceListener, Sweeper
from service.waiters import Waiters

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> web.Application:
    metrics = Metrics()  # per app: tests run many apps in one process
    observe = request_middleware(metrics, access_log=settings.access_log, principal_key=PRINCIPAL)
    app = web.Application(
        middlewares=[observe, problem_middleware, auth_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app.add_routes(ROUTES)
    app.cleanup_ctx.append(redis_ctx)
    app.cleanup_ctx.append(waiters_ctx)
    app.cleanup_ctx.append(events_ctx)
    app.cleanup_ctx.append(background_ctx)
    app.cleanup_ctx.append(observability_ctx)
    app.on_shutdown.append(release_long_requests)
    return app


async def release_long_requests(app: web.Application) -> None:
    """On SIGTERM, before aiohttp waits for the handlers: parked long polls return the question
    as it stands (200, still pending, so the client polls again, on another process) and event
    streams end (the client resumes with Last-Event-ID). Without it, shutdown waited for each up
    to its timeout (60 s), past Kubernetes' grace period, and the pod was killed mid-cleanup."""
    app[WAITERS].release_all()
    app[EVENT_HUB].end_streams()


async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    redis = connect(settings)
    blocking = connect_blocking(settings, redis)
    durability = Durability(settings.wait_replicas, settings.wait_timeout_ms)
    scripts = Scripts(redis, shebang=not settings.in_memory, durability=durability)
    scripts.metrics = app[METRICS]
    try:
        await scripts.load_all()
    except STORE_DOWN as exc:
        log.warning("Redis is not reachable at start (%s); requests get 503 until it is", exc)
    store = QuestionStore(redis, scripts, settings)
    keys = Keys(settings.key_prefix)
    app[REDIS] = redis
    app[SCRIPTS] = scripts
    app[STORE] = store
    app[DIRECTORY] = Directory(
        redis, keys, settings.admin_token, settings.auth_cache_seconds, reads=scripts.coalescer
    )
    app[SWEEPER] = Sweeper(store, settings.sweep_interval_seconds)
    app[LISTENER] = KeyspaceListener(redis, store, keys)
    app[RELAY] = EventRelay(
        redis,
        keys,
        maxlen=settings.events_maxlen,
        ttl_seconds=settings.retention_seconds,
        blocking=blocking,
    )
    app[BLOCKING_REDIS] = blocking
    workers = DeliveryWorkers(redis, scripts, settings, blocking=blocking)
    app[DELIVERY_WORKERS], app[WEBHOOKS], app[DELIVERIES] = workers, workers.registry, workers.store
    app[ACTIONS] = Actions(redis, keys, workers.server_keys, app[DIRECTORY], settings.retention_seconds)
    try:
        # Made now, not by the first action link, so a refused request never writes them.
        await workers.server_keys.action_key()
    except STORE_DOWN as exc:
        log.warning("cannot read the server keys yet (%s); the first Ping will", exc)
    yield
    await scripts.aclose()
    if blocking is not redis:
        await blocking.aclose()
    await redis.aclose()


async def waiters_ctx(app: web.Application) -> AsyncIterator[None]:
    waiters = Waiters(app[REDIS], app[STORE])
    await waiters.start()
    app[WAITERS] = waiters
    app[QUESTIONS] = QuestionService(
        app[STORE], app[DIRECTORY], waiters, waits_per_principal=app[SETTINGS].waits_per_principal
    )
    yield
    await waiters.stop()


async def ensure_groups_quietly(relay: EventRelay) -> None:
    """Create the relay's consumer groups before serving, so no early event goes unrelayed."""
    try:
        await relay.ensure_groups()
    except STORE_DOWN as exc:
        log.warning("cannot create the event relay's groups yet (%s); the relay will retry", exc)


async def events_ctx(app: web.Application) -> AsyncIterator[None]:
    hub = EventHub(app[REDIS], Keys(app[SETTINGS].key_prefix), blocking=app[BLOCKING_REDIS])
    await hub.start()
    app[EVENT_HUB] = hub
    yield
    await hub.stop()


async def background_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    tasks = []
    if settings.run_sweeper:
        tasks.append(asyncio.create_task(app[SWEEPER].run(), name="sweeper"))
    if settings.keyspace_notifications and not settings.in_memory:
        tasks.append(asyncio.create_task(app[LISTENER].run(), name="keyspace-listener"))
    if settings.run_event_relay:
        await ensure_groups_quietly(app[RELAY])
        tasks.append(asyncio.create_task(app[RELAY].run(), name="event-relay"))
    if settings.run_delivery:
        await app[DELIVERY_WORKERS].start()
    yield
    await app[DELIVERY_WORKERS].stop()
    for loop in (app[SWEEPER], app[LISTENER], app[RELAY]):
        loop.stopping = True
    await stop_tasks(tasks)


async def observability_ctx(app: web.Application) -> AsyncIterator[None]:
    """Hand the components to /metrics, check the Redis settings once, and serve /metrics on
    QS_METRICS_PORT too when it is set."""
    metrics = app[METRICS]
    metrics.waiters, metrics.hub = app[WAITERS], app[EVENT_HUB]
    metrics.sweeper, metrics.listener, metrics.relay = app[SWEEPER], app[LISTENER], app[RELAY]
    metrics.sender = app[DELIVERY_WORKERS].sender
    metrics.outbox_consumers = [app[RELAY], app[DELIVERY_WORKERS].fanout]
    metrics.coalescer = app[SCRIPTS].coalescer
    metrics.caches = {
        **app[DIRECTORY].caches(),
        "question_targets": app[QUESTIONS].targets,
        "rendered_envelopes": RENDERED,
    }
    app[WAITERS].metrics = metrics
    await check_redis_at_start(app)
    runner = await metrics_site(app)
    yield
    if runner is not None:
        await runner.cleanup()


async def check_redis_at_start(app: web.Application) -> None:
    """Say loudly, once, when the Redis settings can lose questions or delay expiry."""
    settings = app[SETTINGS]
    try:
        async with asyncio.timeout(settings.redis_timeout_seconds):
            if settings.keyspace_notifications and not settings.in_memory:
                # The listener task does this too; doing it first keeps the check from racing it.
                await app[LISTENER].enable_notifications()
            checks = await redis_checks(app[REDIS], settings)
    except (RedisError, OSError) as exc:
        log.warning("cannot check the Redis settings at start (%s); /readyz checks them", exc)
        return
    for check in checks:
        if check.state is not CheckState.OK:
            log.warning("Redis %s %s: %s", check.name, check.state.value, check.detail)


async def metrics_site(app: web.Application) -> web.AppRunner | None:
    """GET /metrics on QS_METRICS_PORT too, when it is set (same figures as the main port)."""
    settings = app[SETTINGS]
    if not settings.metrics_port:
        return None
    metrics, keys = app[METRICS], Keys(settings.key_prefix)

    async def render(accept: str) -> tuple[bytes, str]:
        await metrics.refresh_from_redis(app[REDIS], keys, settings.redis_timeout_seconds)
        return metrics.render(accept)

    return await start_metrics_site(render, settings.host, settings.metrics_port)
