"""create_app(settings): the aiohttp application with its Redis, pub/sub and background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from service.auth import Directory
from service.backoff import stop_tasks
from service.events import EventHub, EventRelay
from service.http.appkeys import (
    BLOCKING_REDIS,
    DIRECTORY,
    EVENT_HUB,
    LISTENER,
    QUESTIONS,
    REDIS,
    RELAY,
    SCRIPTS,
    SETTINGS,
    STORE,
    SWEEPER,
    WAITERS,
)
from service.http.problems import STORE_DOWN, problem_middleware
from service.http.routes import ROUTES, auth_middleware
from service.keys import Keys
from service.questions import QuestionService
from service.redis_client import connect, connect_blocking
from service.scripts import Scripts
from service.settings import Settings
from service.store import QuestionStore
from service.sweeper import KeyspaceListener, Sweeper
from service.waiters import Waiters

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> web.Application:
    app = web.Application(
        middlewares=[problem_middleware, auth_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app.add_routes(ROUTES)
    app.cleanup_ctx.append(redis_ctx)
    app.cleanup_ctx.append(waiters_ctx)
    app.cleanup_ctx.append(events_ctx)
    app.cleanup_ctx.append(background_ctx)
    return app


async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    redis = connect(settings)
    blocking = connect_blocking(settings, redis)
    scripts = Scripts(redis, shebang=not settings.in_memory)
    try:
        await scripts.load_all()
    except STORE_DOWN as exc:
        log.warning("Redis is not reachable at start (%s); requests get 503 until it is", exc)
    store = QuestionStore(redis, scripts, settings)
    keys = Keys(settings.key_prefix)
    app[REDIS] = redis
    app[SCRIPTS] = scripts
    app[STORE] = store
    app[DIRECTORY] = Directory(redis, keys, settings.admin_token, settings.auth_cache_seconds)
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
    yield
    await scripts.aclose()
    if blocking is not redis:
        await blocking.aclose()
    await redis.aclose()


async def waiters_ctx(app: web.Application) -> AsyncIterator[None]:
    waiters = Waiters(app[REDIS], app[STORE])
    await waiters.start()
    app[WAITERS] = waiters
    app[QUESTIONS] = QuestionService(app[STORE], app[DIRECTORY], waiters)
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
    yield
    for loop in (app[SWEEPER], app[LISTENER], app[RELAY]):
        loop.stopping = True
    await stop_tasks(tasks)
