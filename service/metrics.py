"""Prometheus metrics: one registry per application, cheap hooks on the hot path.

The figures every request or script call moves (HTTP requests and durations, script durations
and outcomes) are plain Python numbers per label set, turned into metric families at scrape:
prometheus_client's own children take a lock and check their state on every call, which cost
~8.5 µs of a fetch's ~91 µs of CPU under load (docs/benchmarks.md). Figures that already live on
the components (waiters, sweeper totals, SSE subscribers, relay counts) are read only when
Prometheus scrapes, by a collector, so they cost nothing between scrapes. Figures about Redis as
a whole (the oldest overdue deadline, the outbox backlog, pending questions) are read from Redis
once per scrape.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.errors import Unavailable
from service.keys import Keys
from service.scripts import ScriptMisuse
from service.stats import deadline_backlog, delivery_backlog, outbox_backlog

if TYPE_CHECKING:
    from service.scripts import Reply

# No `_created` sample per counter and histogram child: it doubles a scrape and nobody reads it.
disable_created_metrics()  # type: ignore[no-untyped-call]

log = logging.getLogger(__name__)

# Long polls last up to QS_WAIT_MAX_SECONDS: the top buckets keep them apart from failures.
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REDIS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
WAKE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"})
UNMATCHED = "unmatched"  # the route label of a request no route matched (never the raw path)

# (script, reply code) -> (kind, result) of qs_transitions_total. Codes not listed (a read that
# finds a question pending or already terminal) are not transitions and are not counted.
KIND = {"create": "created", "answer": "answered", "cancel": "cancelled", "expire": "expired"}
RESULT = {
    "created": "applied",
    "applied": "applied",
    "replayed": "replayed",
    "stale": "stale",
    "not_found": "not_found",
    "not_eligible": "not_eligible",
    "unknown_option": "refused",
    "not_asker": "refused",
    "idempotency_conflict": "refused",
    "bad_deadline": "refused",
    "full": "refused",
}
# expire_many's codes: 'stale' is a sweeper or listener that came second; 'pending' and
# 'not_found' are no transition.
BATCH_RESULT = {"applied": "applied", "again": "replayed", "stale": "stale"}
TRANSITION_RESULTS = ("applied", "stale", "replayed", "refused", "not_found", "not_eligible")
MECHANISMS = ("inline", "notification", "sweep")
ERROR_KINDS = ("connection", "timeout", "refused", "misuse", "other")


class _Waiters(Protocol):
    @property
    def waiting(self) -> int: ...
    @property
    def channels(self) -> int: ...

    reconnects: int
    resubscriptions: int


class _Hub(Protocol):
    @property
    def connections(self) -> int: ...


class _SweepTotals(Protocol):
    expired: int
    purged: int
    passes: int


class _Sweeper(Protocol):
    @property
    def totals(self) -> _SweepTotals: ...

    failures: int


class _Listener(Protocol):
    expired: int


class _Relay(Protocol):
    @property
    def relayed(self) -> int: ...


class _OutboxConsumer(Protocol):
    group: str
    skipped: int


class _Coalescer(Protocol):
    replication_unconfirmed: int


class _Sender(Protocol):
    @property
    def attempts(self) -> Mapping[tuple[str, str], int]: ...


class Metrics:
    """Every metric of one process (one application), in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_TallyCollector(self))
        self.wake_latency = Histogram(
            "qs_wake_latency_seconds", "From a question's resolved_at (Redis TIME; for an expiry "
            "the deadline) to the moment its waiter can answer.", buckets=WAKE_BUCKETS, registry=r,
        )  # fmt: skip
        self.redis_errors = Counter(
            "qs_redis_errors", "Script calls that failed in Redis, by kind "
            "connection|timeout|refused|misuse|other.", ["script", "kind"], registry=r,
        )  # fmt: skip
        self.oldest_overdue = Gauge(
            "qs_oldest_overdue_pending_seconds", "Redis TIME minus the oldest deadline still in "
            "the deadline index that has passed (0 when none); read at scrape.", registry=r,
        )  # fmt: skip
        self.outbox_backlog = Gauge(
            "qs_outbox_backlog", "Outbox entries the event relay's group has not acknowledged "
            "(lag + pending, all buckets); read at scrape.", registry=r,
        )  # fmt: skip
        self.pending = Gauge(
            "qs_pending_questions", "Questions in the deadline index (pending); read at scrape.",
            registry=r,
        )  # fmt: skip
        self.deliveries_due = Gauge(
            "qs_deliveries_due", "Webhook and Ping deliveries waiting for an attempt (all buckets); "
            "read at scrape.", registry=r,
        )  # fmt: skip
        self.dead_letters = Gauge(
            "qs_dead_letters", "Deliveries that failed their last attempt and can be replayed "
            "(within the retention); read at scrape.", registry=r,
        )  # fmt: skip
        self.scrape_ok = Gauge(
            "qs_redis_scrape_ok", "1 when the last scrape could read its figures from Redis.",
            registry=r,
        )  # fmt: skip
        self.inline_expired = 0  # expiries noticed by a read, answer or cancel (see script_done)
        self.waiters: _Waiters | None = None
        self.hub: _Hub | None = None
        self.sweeper: _Sweeper | None = None
        self.listener: _Listener | None = None
        self.relay: _Relay | None = None
        self.outbox_consumers: list[_OutboxConsumer] = []
        self.sender: _Sender | None = None
        self.coalescer: _Coalescer | None = None
        self.caches: dict[str, Sized] = {}  # bounded in-process caches, by name
        self._http_requests: dict[tuple[str, str, str], int] = {}  # (route, method, status)
        self._http_durations: dict[tuple[str, str], _Tally] = {}  # (route, method)
        self._scripts: dict[str, _Tally] = {}
        self._outcomes: dict[tuple[str, str], int] = {}  # (kind, result)
        self._prebind()
        r.register(_LiveCollector(self))

    def _prebind(self) -> None:
        """Every known label combination exists from the start, at 0, so rates and alerts work
        before the first event (a series that appears later hides its first increment)."""
        for kind in KIND.values():
            for result in TRANSITION_RESULTS:
                self._outcomes[(kind, result)] = 0
        for script in (*KIND, "purge"):
            self._scripts[script] = _Tally(REDIS_BUCKETS)
            for error in ERROR_KINDS:
                self.redis_errors.labels(script, error)

    # -- HTTP -----------------------------------------------------------------------------------

    def http_done(self, route: str, method: str, status: int, seconds: float) -> None:
        if method not in METHODS:
            method = "other"
        key = (route, method, str(status))
        self._http_requests[key] = self._http_requests.get(key, 0) + 1
        tally = self._http_durations.get((route, method))
        if tally is None:
            tally = self._http_durations[(route, method)] = _Tally(HTTP_BUCKETS)
        tally.observe(seconds)

    # -- scripts --------------------------------------------------------------------------------

    def script_done(self, name: str, args: Mapping[str, str | int], reply: Reply, seconds: float) -> None:
        self._script_took(name, seconds)
        kind = KIND.get(name)
        if kind is None:
            return
        code = reply.code.value
        if code == "rooms_needed":  # a first call that learned only the question's room
            return
        if reply.again:  # its first run was counted; this one only reports it again
            self._outcomes[(kind, "replayed")] += 1
            return
        if name == "expire":  # a read (fetch, list, wait); finding it terminal is no transition
            if code == "applied":
                self._outcomes[(kind, "applied")] += 1
                self.inline_expired += 1
            return
        if reply.expired_now:  # a late answer or cancel expired the question: stale tap + expiry
            self._outcomes[("expired", "applied")] += 1
            self.inline_expired += 1
        self._outcomes[(kind, RESULT[code])] += 1

    def codes_done(self, name: str, codes: Sequence[str], seconds: float) -> None:
        """One call of expire_many (the sweeper and the keyspace listener): a code per question."""
        self._script_took(name, seconds)
        for code in codes:
            result = BATCH_RESULT.get(code)
            if result is not None:
                self._outcomes[("expired", result)] += 1

    def _script_took(self, name: str, seconds: float) -> None:
        tally = self._scripts.get(name)
        if tally is None:
            tally = self._scripts[name] = _Tally(REDIS_BUCKETS)
        tally.observe(seconds)

    def script_failed(self, name: str, exc: BaseException) -> None:
        self.redis_errors.labels(name, error_kind(exc)).inc()

    # -- waiters --------------------------------------------------------------------------------

    def woke(self, resolved_ms: str | None) -> None:
        """A waiter is about to answer with a terminal question resolved at `resolved_ms`."""
        if resolved_ms:
            self.wake_latency.observe(max(0.0, time.time() - int(resolved_ms) / 1000))

    # -- scrape ---------------------------------------------------------------------------------

    async def refresh_from_redis(self, redis: Redis, keys: Keys, timeout: float) -> None:
        """Read the Redis-wide figures once per scrape. A failure is counted and logged, and the
        scrape still serves every other figure (with qs_redis_scrape_ok 0)."""
        try:
            async with asyncio.timeout(timeout):
                backlog = await deadline_backlog(redis, keys)
                outbox = await outbox_backlog(redis, keys)
                delivery = await delivery_backlog(redis, keys)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.scrape_ok.set(0)
            self.redis_errors.labels("scrape", error_kind(exc)).inc()
            log.warning("metrics: cannot read the Redis figures (%s: %s)", type(exc).__name__, exc)
            return
        self.pending.set(backlog.pending)
        self.oldest_overdue.set(backlog.oldest_overdue_seconds)
        self.outbox_backlog.set(sum(b.backlog for b in outbox))
        self.deliveries_due.set(delivery.due)
        self.dead_letters.set(delivery.dead)
        self.scrape_ok.set(1)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The registry in the format `accept` asks for (Prometheus text unless OpenMetrics)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "connection"
    if isinstance(exc, Unavailable):
        return "refused"
    if isinstance(exc, ScriptMisuse):
        return "misuse"
    return "other"


class _Tally:
    """One histogram series as plain numbers. The event loop is its only writer; a scrape reads it."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value, as `le` means
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        edges = [*map(floatToGoString, self.bounds), "+Inf"]
        return list(zip(edges, itertools.accumulate(self.counts), strict=True))


class _TallyCollector(Collector):
    """The figures every request and script call moves, from their plain counts at scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        yield _counters(
            "qs_http_requests", "HTTP requests by route template, method and status.",
            ["route", "method", "status"], list(m._http_requests.items()),
        )  # fmt: skip
        yield _histogram(
            "qs_http_request_duration_seconds", "HTTP request duration (long polls included).",
            ["route", "method"], list(m._http_durations.items()),
        )  # fmt: skip
        yield _counters(
            "qs_transitions", "Script outcomes: kind created|answered|cancelled|expired, result "
            "applied|stale|replayed|refused|not_found|not_eligible.", ["kind", "result"],
            list(m._outcomes.items()),
        )  # fmt: skip
        yield _histogram(
            "qs_redis_call_duration_seconds", "Duration of one script call, queueing and "
            "coalescing included.", ["script"], [((name,), t) for name, t in list(m._scripts.items())],
        )  # fmt: skip


def _counters(
    name: str, doc: str, labels: list[str], counts: Iterable[tuple[Sequence[str], int]]
) -> CounterMetricFamily:
    """`counts`: a snapshot (a list), since a scrape may run while requests add series."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, count in counts:
        family.add_metric(values, count)
    return family


def _histogram(
    name: str, doc: str, labels: list[str], tallies: Iterable[tuple[Sequence[str], _Tally]]
) -> HistogramMetricFamily:
    """`tallies`: a snapshot (a list), since a scrape may run while requests add series."""
    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, tally in tallies:
        family.add_metric(values, tally.buckets(), tally.sum)
    return family


class _LiveCollector(Collector):
    """Figures the components keep anyway, read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        yield _gauge("qs_asyncio_tasks", "Tasks of the event loop (len(asyncio.all_tasks())).", _tasks())
        waiters = m.waiters
        yield _gauge("qs_waiters", "Long-poll waiter registrations now.", waiters.waiting if waiters else 0)
        yield _gauge(
            "qs_waiter_channels", "Pub/sub channels subscribed for waiters now.",
            waiters.channels if waiters else 0,
        )  # fmt: skip
        yield _counter(
            "qs_pubsub_reconnects", "Reconnects of the waiters' pub/sub connection.",
            waiters.reconnects if waiters else 0,
        )  # fmt: skip
        yield _counter(
            "qs_pubsub_resubscriptions", "Channels re-subscribed after a reconnect (each re-read).",
            waiters.resubscriptions if waiters else 0,
        )  # fmt: skip
        yield _gauge("qs_sse_streams", "Open Server-Sent-Events streams.", m.hub.connections if m.hub else 0)
        caches = GaugeMetricFamily(
            "qs_cache_entries", "Entries in each bounded in-process cache (see docs/operations.md).",
            labels=["cache"],
        )  # fmt: skip
        for name, cache in sorted(m.caches.items()):
            caches.add_metric([name], len(cache))
        yield caches
        sweeper = m.sweeper
        yield _counter("qs_sweeper_runs", "Completed sweep passes.", sweeper.totals.passes if sweeper else 0)
        yield _counter(
            "qs_sweeper_failures", "Sweep passes that failed (Redis errors); retried with backoff.",
            sweeper.failures if sweeper else 0,
        )  # fmt: skip
        yield _counter(
            "qs_purged", "Terminal questions removed after retention.",
            sweeper.totals.purged if sweeper else 0,
        )  # fmt: skip
        expired = CounterMetricFamily(
            "qs_expired", "Questions expired, by what noticed the deadline first.", labels=["mechanism"]
        )
        expired.add_metric(["inline"], m.inline_expired)
        expired.add_metric(["notification"], m.listener.expired if m.listener else 0)
        expired.add_metric(["sweep"], sweeper.totals.expired if sweeper else 0)
        yield expired
        attempts = CounterMetricFamily(
            "qs_delivery_attempts", "Webhook and Ping delivery attempts by target (webhook|ping) and "
            "outcome (delivered|retry|dead).", labels=["target", "outcome"],
        )  # fmt: skip
        for target in ("webhook", "ping"):
            for outcome in ("delivered", "retry", "dead"):
                attempts.add_metric(
                    [target, outcome], m.sender.attempts.get((target, outcome), 0) if m.sender else 0
                )
        yield attempts
        yield _counter(
            "qs_events_relayed", "Outbox entries relayed to per-principal event streams.",
            m.relay.relayed if m.relay else 0,
        )  # fmt: skip
        skipped = CounterMetricFamily(
            "qs_outbox_skipped", "Outbox entries a consumer group acknowledged without effect: "
            "they failed on their own (not written by the scripts?); each is logged.", labels=["group"],
        )  # fmt: skip
        for consumer in m.outbox_consumers:
            skipped.add_metric([consumer.group], consumer.skipped)
        yield skipped
        yield _counter(
            "qs_replication_unconfirmed", "WAITs after answer/cancel (QS_WAIT_REPLICAS) that fewer "
            "replicas confirmed in time, per node and batch.",
            m.coalescer.replication_unconfirmed if m.coalescer else 0,
        )  # fmt: skip


def _tasks() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # collected outside the event loop: no loop, no tasks
        return 0


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


Render = Callable[[str], Awaitable[tuple[bytes, str]]]


async def start_metrics_site(render: Render, host: str, port: int) -> web.AppRunner | None:
    """A second, tiny site in the process: GET /metrics on `port` (QS_METRICS_PORT). Used by
    `serve` beside its main port and by `worker` and `sweep`, which have no other HTTP."""

    async def metrics_only(request: web.Request) -> web.Response:
        body, content_type = await render(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    site_app = web.Application()
    site_app.router.add_get("/metrics", metrics_only)
    runner = web.AppRunner(site_app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        # The process must not fail for its metrics.
        log.warning("cannot serve /metrics on port %d (%s)", port, exc)
        await runner.cleanup()
        return None
    log.info("metrics on http://%s:%d/metrics", host, port)
    return runner
