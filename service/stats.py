"""What the Redis behind the service holds and how it is configured: the figures of `question-service
stats`, the Redis-wide gauges of /metrics, and the settings checks of start-up and /readyz.

Everything here only reads. The deadline and outbox figures cost a few commands per bucket in one
pipeline; only `stats` counts the per-principal event streams, with SCAN.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service.keys import BUCKETS, Keys
from service.redis_client import as_cluster, connect, is_cluster
from service.settings import Settings

COUNTERS = ("created", "answered", "expired", "cancelled", "stale")
T = TypeVar("T")
RELAY_GROUP = "events"  # service.events.GROUP; not imported, to keep this module light


# -- deadlines, purge, outboxes -----------------------------------------------------------------


async def redis_time_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


@dataclass(frozen=True)
class DeadlineBacklog:
    now_ms: int
    by_bucket: list[int]  # ZCARD of each bucket's deadline index: its pending questions
    overdue: int  # deadlines that have passed, still in the index (not yet expired)
    oldest_overdue_seconds: float  # now minus the oldest passed deadline; 0 when none

    @property
    def pending(self) -> int:
        return sum(self.by_bucket)


async def deadline_backlog(redis: Redis, keys: Keys) -> DeadlineBacklog:
    now = await redis_time_ms(redis)
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.zcard(keys.deadlines(b))
            pipe.zcount(keys.deadlines(b), "-inf", now)
            pipe.zrange(keys.deadlines(b), 0, 0, withscores=True)
        replies = await pipe.execute()
    cards, overdue, oldest = replies[0::3], replies[1::3], replies[2::3]
    earliest = min((float(first[0][1]) for first in oldest if first), default=None)
    lateness = 0.0 if earliest is None or earliest > now else (now - earliest) / 1000
    return DeadlineBacklog(now, [int(c) for c in cards], sum(int(n) for n in overdue), lateness)


@dataclass(frozen=True)
class OutboxFigures:
    length: int  # XLEN
    backlog: int  # entries the relay's group has not acknowledged: lag + pending


async def outbox_backlog(redis: Redis, keys: Keys) -> list[OutboxFigures]:
    """Per bucket. Without the relay's group (no relay ever ran), every entry is backlog. When
    Redis cannot tell the group's lag (entries deleted with XDEL), the length is the bound."""
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.xlen(keys.outbox(b))
            pipe.xinfo_groups(keys.outbox(b))
        replies = await pipe.execute(raise_on_error=False)
    figures = []
    for length, groups in zip(replies[0::2], replies[1::2], strict=True):
        if isinstance(length, Exception):
            raise length
        figures.append(OutboxFigures(int(length), _unacknowledged(int(length), groups)))
    return figures


def _unacknowledged(length: int, groups: Any) -> int:
    if isinstance(groups, ResponseError) and "no such key" in str(groups).lower():
        return length  # nothing written yet (length 0)
    if isinstance(groups, Exception):
        raise groups
    for group in groups:
        if str(group.get("name")) == RELAY_GROUP:
            lag = group.get("lag")
            if lag is None:  # the group's delivered-but-unacknowledged entries are in the length
                return length
            return int(lag) + int(group.get("pending") or 0)
    return length


# -- the whole picture, for `question-service stats` ----------------------------------------------


async def counters(redis: Redis, keys: Keys) -> dict[str, int]:
    """The scripts' per-bucket counters (qs:{bN}:stats), summed."""
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.hgetall(keys.stats(b))
        hashes = await pipe.execute()
    totals = dict.fromkeys(COUNTERS, 0)
    for counts in hashes:
        for name, value in counts.items():
            totals[str(name)] = totals.get(str(name), 0) + int(value)
    return totals


async def purge_backlog(redis: Redis, keys: Keys, now_ms: int) -> dict[str, int]:
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.zcard(keys.purge(b))
            pipe.zcount(keys.purge(b), "-inf", now_ms)
        replies = await pipe.execute()
    return {"scheduled": sum(replies[0::2]), "due": sum(replies[1::2])}


async def event_streams(redis: Redis, keys: Keys) -> dict[str, int]:
    """Count and total length of the per-principal event streams (SCAN: O(keys in Redis))."""
    found = [key async for key in redis.scan_iter(match=keys.events("*"), count=1000, _type="stream")]
    total = 0
    for start in range(0, len(found), 500):
        async with redis.pipeline(transaction=False) as pipe:
            for key in found[start : start + 500]:
                pipe.xlen(key)
            total += sum(await pipe.execute())
    return {"count": len(found), "entries": total}


async def each_server(redis: Redis, call: Callable[[Redis, dict[str, Any]], Awaitable[T]]) -> dict[str, T]:
    """`call(client, options)` once per Redis server that holds questions: every primary of a
    cluster (options target it; INFO and CONFIG would otherwise reach one node), or the one server.
    Keyed by the node's host:port ("" for a single server)."""
    if not is_cluster(redis):
        return {"": await call(redis, {})}
    cluster = as_cluster(redis)
    primaries = sorted(cluster.get_primaries(), key=lambda node: node.name)
    return {node.name: await call(redis, {"target_nodes": node}) for node in primaries}


async def _memory_and_clients(redis: Redis, options: dict[str, Any]) -> dict[str, Any]:
    memory = await redis.info("memory", **options)
    clients = await redis.info("clients", **options)
    return {
        "used_memory": int(memory.get("used_memory", 0)),
        "used_memory_human": memory.get("used_memory_human"),
        "maxmemory": int(memory.get("maxmemory", 0)),
        "maxmemory_human": memory.get("maxmemory_human"),
        "maxmemory_policy": memory.get("maxmemory_policy"),
        "connected_clients": int(clients.get("connected_clients", 0)),
    }


async def server_figures(redis: Redis) -> dict[str, Any]:
    """Memory and clients; on a cluster, summed over the primaries, with each one under `nodes`."""
    servers = await each_server(redis, _memory_and_clients)
    if list(servers) == [""]:
        one = servers[""]
        return {
            "memory": {k: v for k, v in one.items() if k != "connected_clients"},
            "connected_clients": one["connected_clients"],
        }
    used = sum(s["used_memory"] for s in servers.values())
    limits = [s["maxmemory"] for s in servers.values()]
    policies = sorted({str(s["maxmemory_policy"]) for s in servers.values()})
    return {
        "memory": {
            "used_memory": used,
            "used_memory_human": _human(used),
            "maxmemory": 0 if 0 in limits else sum(limits),  # 0: one primary at least is unbounded
            "maxmemory_human": _human(0 if 0 in limits else sum(limits)),
            "maxmemory_policy": ",".join(policies),
        },
        "connected_clients": sum(s["connected_clients"] for s in servers.values()),
        "nodes": servers,
    }


def _human(size: int) -> str:
    """Bytes the way INFO prints them (used_memory_human)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.2f}{unit}"
    return f"{size}B"


async def collect(redis: Redis, settings: Settings) -> dict[str, Any]:
    """Everything `question-service stats` prints, as one JSON-ready dict."""
    keys = Keys(settings.key_prefix)
    deadlines = await deadline_backlog(redis, keys)
    outboxes = await outbox_backlog(redis, keys)
    checks = await redis_checks(redis, settings)
    return {
        "key_prefix": settings.key_prefix,
        "redis_time_ms": deadlines.now_ms,
        "counters": await counters(redis, keys),
        "pending": deadlines.pending,
        "deadlines": {
            "by_bucket": deadlines.by_bucket,
            "overdue": deadlines.overdue,
            "oldest_overdue_seconds": deadlines.oldest_overdue_seconds,
        },
        "purge": await purge_backlog(redis, keys, deadlines.now_ms),
        "outboxes": {
            "length": sum(o.length for o in outboxes),
            "backlog": sum(o.backlog for o in outboxes),
            "by_bucket": [asdict(o) for o in outboxes],
        },
        "event_streams": await event_streams(redis, keys),
        **(await server_figures(redis)),
        "checks": {c.name: c.public() for c in checks},
    }


async def run(settings: Settings, *, as_json: bool) -> dict[str, Any] | str:
    """`question-service stats`: the figures as a dict (printed as JSON) or as text."""
    redis = connect(settings)
    try:
        figures = await collect(redis, settings)
    finally:
        await redis.aclose()
    return figures if as_json else render_text(figures)


def render_text(figures: dict[str, Any]) -> str:
    """A human-readable summary of `collect`'s result."""
    c, d, o, m = figures["counters"], figures["deadlines"], figures["outboxes"], figures["memory"]
    lines = [
        f"key prefix       {figures['key_prefix']}",
        "counters         " + "  ".join(f"{name} {c.get(name, 0)}" for name in COUNTERS),
        f"pending          {figures['pending']}",
        f"deadlines        overdue {d['overdue']}  oldest overdue {d['oldest_overdue_seconds']:.3f} s"
        f"  per bucket {' '.join(str(n) for n in d['by_bucket'])}",
        f"purge            scheduled {figures['purge']['scheduled']}  due {figures['purge']['due']}",
        f"outboxes         entries {o['length']}  not yet relayed {o['backlog']}",
        f"event streams    {figures['event_streams']['count']} streams,"
        f" {figures['event_streams']['entries']} entries",
        f"memory           used {m['used_memory_human']}  maxmemory {m['maxmemory_human']}"
        f"  policy {m['maxmemory_policy']}",
        f"clients          {figures['connected_clients']} connected",
    ]
    for node, figures_of_node in figures.get("nodes", {}).items():
        lines.append(
            f"primary {node:<21} used {figures_of_node['used_memory_human']}"
            f"  maxmemory {figures_of_node['maxmemory_human']}  policy {figures_of_node['maxmemory_policy']}"
            f"  clients {figures_of_node['connected_clients']}"
        )
    for name, check in figures["checks"].items():
        lines.append(f"check {name:<22} {check['state']}: {check['detail']}")
    return "\n".join(lines)


# -- settings that can lose questions -----------------------------------------------------------


class CheckState(enum.StrEnum):
    OK = "ok"
    DEGRADED = "degraded"  # works, with a weaker promise (later expiry, lossier crash)
    AT_RISK = "at_risk"  # questions can be lost
    UNKNOWN = "unknown"  # Redis would not say (CONFIG refused)


@dataclass(frozen=True)
class Check:
    name: str
    state: CheckState
    detail: str

    def public(self) -> dict[str, str]:
        return {"state": self.state.value, "detail": self.detail}


async def redis_checks(redis: Redis, settings: Settings) -> list[Check]:
    """The Redis settings that decide whether questions survive: eviction, persistence, and
    keyspace notifications (prompt expiry). On a cluster, every primary is read and each check
    reports its worst state, naming the primaries in it."""
    if settings.in_memory:
        return [
            Check("backend", CheckState.AT_RISK, "memory:// keeps nothing: a restart loses every question")
        ]

    async def checks_of(client: Redis, options: dict[str, Any]) -> list[Check]:
        memory = await client.info("memory", **options)
        config = await _config(client, options, "appendonly", "appendfsync", "save", "notify-keyspace-events")
        persistence = await client.info("persistence", **options) if config is None else {}
        return [
            eviction_check(memory),
            persistence_check(config, persistence),
            notifications_check(config, settings),
        ]

    return worst_of(await each_server(redis, checks_of))


SEVERITY = {CheckState.OK: 0, CheckState.UNKNOWN: 1, CheckState.DEGRADED: 2, CheckState.AT_RISK: 3}


def worst_of(by_server: dict[str, list[Check]]) -> list[Check]:
    """One list of checks from each server's: per check, the worst state, and where it is."""
    if len(by_server) == 1:
        return next(iter(by_server.values()))
    combined = []
    for checks in zip(*by_server.values(), strict=True):
        worst = max(checks, key=lambda check: SEVERITY[check.state])
        where = [name for name, check in zip(by_server, checks, strict=True) if check.state is worst.state]
        scope = (
            "every primary" if len(where) == len(by_server) else f"{len(where)} of {len(by_server)} primaries"
        )
        combined.append(Check(worst.name, worst.state, f"{worst.detail} ({scope}: {', '.join(where)})"))
    return combined


async def _config(redis: Redis, options: dict[str, Any], *names: str) -> dict[str, str] | None:
    """CONFIG GET of each name, or None when the server refuses CONFIG (managed services)."""
    try:
        found = await redis.config_get(*names, **options)  # one round trip: Redis 7 takes several names
    except ResponseError:
        return None
    return {str(k): str(v) for k, v in found.items()}


def eviction_check(memory: dict[str, Any]) -> Check:
    policy = str(memory.get("maxmemory_policy", "unknown"))
    if policy == "noeviction":
        return Check("maxmemory_policy", CheckState.OK, "noeviction: a full Redis refuses writes (503)")
    return Check(
        "maxmemory_policy",
        CheckState.AT_RISK,
        f"maxmemory-policy is {policy}: a full Redis evicts keys, and can silently lose questions, "
        "deadline markers and index entries; set noeviction",
    )


def persistence_check(config: dict[str, str] | None, persistence: dict[str, Any]) -> Check:
    if config is None:
        if str(persistence.get("aof_enabled")) == "1":
            return Check("persistence", CheckState.OK, "appendonly yes (CONFIG refused; read from INFO)")
        return Check(
            "persistence",
            CheckState.UNKNOWN,
            "CONFIG is refused and AOF is off: cannot tell whether RDB snapshots are configured",
        )
    if config.get("appendonly") == "yes":
        return Check("persistence", CheckState.OK, f"appendonly yes, appendfsync {config.get('appendfsync')}")
    if config.get("save", "").strip():
        return Check(
            "persistence",
            CheckState.DEGRADED,
            f"RDB snapshots only (save {config['save']}): a crash loses the writes since the last "
            "snapshot; set appendonly yes",
        )
    return Check(
        "persistence",
        CheckState.AT_RISK,
        "persistence is off (no AOF, no RDB save): a Redis restart loses every question",
    )


def notifications_check(config: dict[str, str] | None, settings: Settings) -> Check:
    name = "keyspace_notifications"
    if config is None:
        return Check(name, CheckState.UNKNOWN, "CONFIG is refused: cannot read notify-keyspace-events")
    flags = config.get("notify-keyspace-events", "")
    if "E" in flags and ("x" in flags or "A" in flags):
        return Check(name, CheckState.OK, f"notify-keyspace-events {flags}")
    why = "" if settings.keyspace_notifications else " (QS_KEYSPACE_NOTIFICATIONS=false here)"
    return Check(
        name,
        CheckState.DEGRADED,
        f"notify-keyspace-events is {flags or 'empty'}{why}: expiry relies on the sweeper alone, "
        f"up to QS_SWEEP_INTERVAL_SECONDS ({settings.sweep_interval_seconds:g} s) late",
    )


LOSSY = frozenset({CheckState.AT_RISK})


def warnings_of(checks: Sequence[Check]) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in checks if c.state is not CheckState.OK]


@dataclass(frozen=True)
class DeliveryFigures:
    due: int  # delivery records waiting for an attempt (pending, leased or not)
    dead: int  # entries in the dead-letter streams


async def delivery_backlog(redis: Redis, keys: Keys) -> DeliveryFigures:
    async with redis.pipeline(transaction=False) as pipe:
        for b in range(BUCKETS):
            pipe.zcard(keys.deliveries_due(b))
            pipe.xlen(keys.dead_letters(b))
        replies = await pipe.execute()
    return DeliveryFigures(sum(int(n) for n in replies[0::2]), sum(int(n) for n in replies[1::2]))
