"""The Redis client: redis-py asyncio with bounded, safe retries, a Redis Cluster client for
``redis+cluster://`` URLs, or an in-process fakeredis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterUnreachableError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.settings import CLUSTER_SCHEMES, Settings, SettingsError

log = logging.getLogger(__name__)
# Every state-changing script carries a call id, so a retried call that already ran reports
# its first outcome; two retries ride out a reconnect without hiding an outage.
RETRIES = 2
# On a cluster, a failover or a slot move makes a node refuse or drop connections for a second
# or two, and redis-py's error handling then resets other tasks' connections to that node for a
# while longer: calls are retried with these pauses (about 5 s in all) on the re-read topology.
FAILOVER_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0)
# AttributeError: redis-py 8.1 can null a connection's writer while another task is connecting
# it, when a node is dropped (seen during CLUSTER FAILOVER); the call itself never ran.
FAILOVER_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    SlotNotCoveredError,
    TryAgainError,
    AttributeError,
)
T = TypeVar("T")
# Error replies of a Redis that is there but refuses for now (out of memory, a read-only replica,
# a busy script, loading, a cluster without quorum or mid-resharding): an outage, not a bug.
# redis-py strips the code from the message; it keeps it as status_code.
REFUSAL_CODES = frozenset(
    {"OOM", "MISCONF", "NOREPLICAS", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"}
)
REFUSALS = (OutOfMemoryError, ReadOnlyError, ClusterDownError, TryAgainError)
# Every error that means "Redis is unreachable or refusing for now": a 503 with Retry-After.
OUTAGES = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    SlotNotCoveredError,
    RedisClusterUnreachableError,
    *REFUSALS,
)


def refused_for_now(exc: ResponseError) -> bool:
    code = getattr(exc, "status_code", None) or str(exc).partition(" ")[0]
    return isinstance(exc, REFUSALS) or code in REFUSAL_CODES


def connect(settings: Settings) -> Redis:
    if settings.in_memory:
        return memory_redis()
    if settings.cluster:
        return connect_cluster(settings, socket_timeout=settings.redis_timeout_seconds)
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
    if settings.cluster:
        return connect_cluster(settings, socket_timeout=None)
    return Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=None,
        socket_connect_timeout=settings.redis_timeout_seconds,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )


def connect_cluster(settings: Settings, *, socket_timeout: float | None) -> Redis:
    """redis-py's asyncio cluster client. It follows MOVED/ASK and refreshes the slot map on
    topology changes by itself; `QS_REDIS_MAX_CONNECTIONS` caps the connections per node.

    Typed as `Redis`: the cluster client offers the same command API for every call the service
    makes, and the few places that differ (pub/sub, multi-slot reads, WAIT) ask `is_cluster`."""
    nodes, options = cluster_nodes(settings.redis_url)
    client = BoundedRedisCluster(
        settings.redis_max_connections,
        startup_nodes=nodes,
        decode_responses=True,
        max_connections=2 * settings.redis_max_connections,
        socket_timeout=socket_timeout,
        socket_connect_timeout=settings.redis_timeout_seconds,
        socket_keepalive=True,
        # No retries inside redis-py: its cluster pipeline answers a connection error by closing
        # the whole client (every other task's connections too) and retrying at once. The
        # service retries instead, with pauses (FAILOVER_PAUSES), and every retry is safe: each
        # state-changing script carries its call id.
        retry=Retry(NoBackoff(), 0),
        **options,
    )
    return cast(Redis, client)


async def retry_failover(cluster: RedisCluster, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, again after each pause of FAILOVER_PAUSES while the cluster is failing over;
    the slot map is re-read before each retry."""
    for pause in FAILOVER_PAUSES:
        try:
            return await call()
        except FAILOVER_ERRORS as exc:
            log.info("Redis Cluster call failed (%r); retrying in %.2f s", exc, pause)
        await asyncio.sleep(pause)
        try:
            await cluster.nodes_manager.initialize()
        except FAILOVER_ERRORS as exc:
            log.info("cannot re-read the cluster's slot map yet: %r", exc)
    return await call()


class BoundedRedisCluster(RedisCluster):
    """redis-py's cluster client fails a command with MaxConnectionsError when a node's pool is
    exhausted (it has no blocking pool). Here a burst beyond `concurrency` commands waits for a
    free slot instead, as the single-node BlockingConnectionPool does; each node's pool allows
    twice that, for pipelines and pub/sub connections on top."""

    def __init__(self, concurrency: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._commands = asyncio.Semaphore(concurrency)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await retry_failover(self, lambda: self._bounded(*args, **kwargs))

    async def _bounded(self, *args: Any, **kwargs: Any) -> Any:
        async with self._commands:
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if transaction or shard_hint:
            return super().pipeline(transaction, shard_hint)
        return FailoverPipeline(self)  # type: ignore[abstract]


class FailoverPipeline(ClusterPipeline):
    """A cluster pipeline (no MULTI) that resends the commands a failover cut off: a connection
    error is a per-command result in redis-py's cluster pipeline, even when the command never
    ran. Commands that got a reply are not sent again."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        strategy: Any = self._execution_strategy
        queue = list(strategy._command_queue)  # execute() empties it; a resend needs it back
        cluster = self.cluster_client

        async def once() -> list[Any]:
            strategy._command_queue = list(queue)
            results = await ClusterPipeline.execute(self, False, allow_redirections)
            if any(isinstance(r, FAILOVER_ERRORS) for r in results):
                raise next(r for r in results if isinstance(r, FAILOVER_ERRORS))
            return results

        try:
            results = await retry_failover(cluster, once)
        except FAILOVER_ERRORS as exc:
            if raise_on_error:
                raise
            # Commands that got no reply at all carry the error that stopped them.
            results = [exc if cmd.result is None else cmd.result for cmd in queue]
        if raise_on_error:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results


def cluster_nodes(url: str) -> tuple[list[ClusterNode], dict[str, Any]]:
    """`redis+cluster://[user:password@]host:port[,host:port...]`: the startup nodes (any
    reachable one is enough; the client discovers the rest) and the connection options.
    `rediss+cluster://` connects with TLS."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise SettingsError(f"not a cluster URL: {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    options: dict[str, Any] = {"ssl": parts.scheme.startswith("rediss")}
    if userinfo:
        user, _, password = userinfo.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) or None
    nodes = []
    for address in filter(None, hosts.split(",")):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise SettingsError(f"QS_REDIS_URL: {address!r} is not host:port")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    if not nodes:
        raise SettingsError("QS_REDIS_URL names no cluster node")
    if parts.path not in ("", "/", "/0") or parse_qs(parts.query):
        raise SettingsError("a cluster URL takes no database number and no query options")
    return nodes, options


def is_cluster(redis: object) -> bool:
    return isinstance(redis, RedisCluster)


def as_cluster(redis: object) -> RedisCluster:
    """The cluster client behind a `Redis`-typed reference (see connect_cluster)."""
    if not isinstance(redis, RedisCluster):
        raise TypeError("not a Redis Cluster client")
    return redis


def memory_redis() -> Redis:
    import fakeredis  # only the in-memory mode needs it

    log.warning(
        "QS_REDIS_URL=memory:// -- using an in-process fakeredis: NOTHING IS KEPT, no other "
        "process can see this data, and keyspace notifications do not exist (the sweeper alone "
        "enforces deadlines). Use a real Redis for anything but a first look."
    )
    redis: Redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    return redis
