"""Typed application keys: what create_app puts on the app and handlers read back."""

from __future__ import annotations

from aiohttp import web
from redis.asyncio import Redis

from service.auth import Directory
from service.delivery import DeliveryStore, DeliveryWorkers
from service.events import EventHub, EventRelay
from service.metrics import Metrics
from service.pings import Actions
from service.questions import QuestionService
from service.scripts import Scripts
from service.settings import Settings
from service.store import QuestionStore
from service.sweeper import KeyspaceListener, Sweeper
from service.waiters import Waiters
from service.webhooks import WebhookRegistry

SETTINGS = web.AppKey("settings", Settings)
REDIS = web.AppKey("redis", Redis)
BLOCKING_REDIS = web.AppKey("blocking_redis", Redis)
SCRIPTS = web.AppKey("scripts", Scripts)
STORE = web.AppKey("store", QuestionStore)
DIRECTORY = web.AppKey("directory", Directory)
WAITERS = web.AppKey("waiters", Waiters)
QUESTIONS = web.AppKey("questions", QuestionService)
SWEEPER = web.AppKey("sweeper", Sweeper)
LISTENER = web.AppKey("listener", KeyspaceListener)
EVENT_HUB = web.AppKey("event_hub", EventHub)
RELAY = web.AppKey("relay", EventRelay)
METRICS = web.AppKey("metrics", Metrics)
WEBHOOKS = web.AppKey("webhooks", WebhookRegistry)
DELIVERIES = web.AppKey("deliveries", DeliveryStore)
DELIVERY_WORKERS = web.AppKey("delivery_workers", DeliveryWorkers)
ACTIONS = web.AppKey("actions", Actions)
