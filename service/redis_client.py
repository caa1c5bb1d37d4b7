"""The Redis client: redis-py asyncio with bounded, safe retries, or an in-process fakeredis."""

from __future__ import annotations

import logging

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.settings import Settings

log = logging.getLogger(__name__)
# Every state-changing script carries a call id, so a retried call that already ran reports
# its first outcome; two retries ride out a reconnect without hiding an outage.
RETRIES = 2


def connect(settings: Settings) -> Redis:
    if settings.in_memory:
        return memory_redis()
    # A blocking pool: a burst beyond the cap waits for a free connection (up to the timeout)
    # instead of failing with MaxConnectionsError, which would read as "Redis is down".
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_timeout_seconds,
        decode_responses=True,
        socket_timeout=settings.redis_timeout_seconds,
        socket_connect_timeout=settings.redis_timeout_seconds,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return Redis.from_pool(pool)  # the client owns the pool: aclose() disconnects it


def connect_blocking(settings: Settings, shared: Redis) -> Redis:
    """A client for XREAD/XREADGROUP with BLOCK. Its reads carry no socket timeout: the BLOCK
    bounds them, and redis-py 8.1 on Python 3.11 can lose a task's cancellation inside a read
    under a socket timeout, which hung shutdown. Keepalive still finds a dead peer."""
    if settings.in_memory:
        return shared
    return Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=None,
        socket_connect_timeout=settings.redis_timeout_seconds,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


def memory_redis() -> Redis:
    import fakeredis  # only the in-memory mode needs it

    log.warning(
        "QS_REDIS_URL=memory:// -- using an in-process fakeredis: NOTHING IS KEPT, no other "
        "process can see this data, and keyspace notifications do not exist (the sweeper alone "
        "enforces deadlines). Use a real Redis for anything but a first look."
    )
    redis: Redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    return redis
