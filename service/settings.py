"""The one settings dataclass, read from ``QS_*`` environment variables (or matching flags)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

MEMORY_URL = "memory://"
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
MAX_KEEP_SECONDS = 10 * 365 * 86400


class SettingsError(ValueError):
    """A setting has a value the service cannot run with."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class Settings:
    redis_url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata=_doc(
            "Redis to use. `redis+cluster://host:port[,host:port]` uses a Redis Cluster (any "
            "reachable node; docs/scaling.md). `memory://` runs an in-process fakeredis that keeps "
            "nothing."
        ),
    )
    host: str = field(default="127.0.0.1", metadata=_doc("Address the HTTP server binds."))
    port: int = field(default=8080, metadata=_doc("Port the HTTP server binds."))
    reuse_port: bool = field(
        default=False, metadata=_doc("Bind with SO_REUSEPORT, so several processes share the port.")
    )
    admin_token: str = field(
        default="",
        metadata=_doc("When set, accepted as an admin bearer token (bootstrap). Empty: disabled."),
    )
    key_prefix: str = field(default="qs", metadata=_doc("Prefix of every Redis key and channel."))
    wait_default_seconds: float = field(
        default=30.0, metadata=_doc("Long-poll timeout when the request names none.")
    )
    wait_max_seconds: float = field(
        default=60.0, metadata=_doc("Longest long-poll; larger requests are clamped to it.")
    )
    sweep_interval_seconds: float = field(
        default=0.5, metadata=_doc("How often the sweeper looks for overdue questions.")
    )
    sweep_batch: int = field(
        default=1000, metadata=_doc("Most questions one sweep pass expires or purges per bucket.")
    )
    run_sweeper: bool = field(default=True, metadata=_doc("Run the deadline sweeper inside `serve`."))
    keyspace_notifications: bool = field(
        default=True,
        metadata=_doc("Listen for keyspace expiry events (and enable `Ex` on Redis) inside `serve`."),
    )
    retention_seconds: int = field(
        default=7 * 86400,
        metadata=_doc(
            "How long a terminal question stays readable before it is removed, counted from when its "
            "end was recorded (an expiry noticed late, after every sweeper was down, is still kept "
            "this long)."
        ),
    )
    questions_per_agent: int = field(
        default=1_000_000,
        metadata=_doc(
            "Most questions one agent keeps (pending, and ended ones until the retention removes "
            "them), checked as 1/16 of it in each of the 16 buckets the ids spread over; one more "
            "is a `429 too-many-questions`. Bounds the Redis memory one agent can take."
        ),
    )
    idempotency_ttl_seconds: int = field(
        default=86400, metadata=_doc("How long an `Idempotency-Key` is remembered.")
    )
    max_body_bytes: int = field(
        default=64 * 1024, metadata=_doc("Largest request body accepted (413 above it).")
    )
    body_timeout_seconds: float = field(
        default=10.0,
        metadata=_doc("Longest wait for a request body to arrive in full (408 after it)."),
    )
    keepalive_seconds: float = field(
        default=75.0,
        metadata=_doc(
            "An idle client connection is closed after this long, and so is one whose request "
            "headers have not arrived in full (trickled or not). Keep it above a load balancer's "
            "idle timeout."
        ),
    )
    redis_timeout_seconds: float = field(default=5.0, metadata=_doc("Socket timeout of each Redis call."))
    redis_max_connections: int = field(
        default=64,
        metadata=_doc("Redis connections per process; a burst beyond waits for a free one."),
    )
    auth_cache_seconds: float = field(
        default=2.0,
        metadata=_doc("How long a process caches a token lookup (revocation delay). 0: no cache."),
    )
    outbox_maxlen: int = field(
        default=20_000, metadata=_doc("Approximate length cap of each bucket's outbox stream.")
    )
    run_event_relay: bool = field(
        default=True, metadata=_doc("Relay outbox events to per-principal streams inside `serve`.")
    )
    events_maxlen: int = field(
        default=10_000, metadata=_doc("Approximate length cap of each principal's event stream.")
    )
    sse_heartbeat_seconds: float = field(
        default=15.0, metadata=_doc("Idle time after which an event stream sends a comment line.")
    )
    sse_streams_per_principal: int = field(
        default=10,
        metadata=_doc(
            "Most open `GET /v1/events` streams of one principal in one process; one more is a "
            "`429 too-many-streams`. Each holds a socket for as long as its client stays."
        ),
    )
    waits_per_principal: int = field(
        default=10_000,
        metadata=_doc(
            "Most long polls (`/wait`, batch or single) of one principal parked at once in one "
            "process; one more is a `429 too-many-waits`. Each holds ~15 KiB and a socket."
        ),
    )
    wait_replicas: int = field(
        default=0,
        metadata=_doc(
            "After an answer or cancel, `WAIT` for this many replicas to confirm the write "
            "(0: off). An unconfirmed one is logged and counted, never an error."
        ),
    )
    wait_timeout_ms: int = field(
        default=100, metadata=_doc("Longest `WAIT` for `QS_WAIT_REPLICAS`, in milliseconds.")
    )
    run_delivery: bool = field(
        default=True,
        metadata=_doc("Run the webhook fan-out and sender inside `serve` (`worker` always runs them)."),
    )
    outbound_allow_nets: str = field(
        default="",
        metadata=_doc(
            "Comma-separated CIDRs that webhooks may reach although they are loopback, private, "
            "link-local or reserved (refused by default)."
        ),
    )
    webhook_timeout_seconds: float = field(
        default=10.0, metadata=_doc("A webhook attempt without a 2xx within this time is retried.")
    )
    webhook_retry_schedule: str = field(
        default="5,30,120,600,1800,3600,10800,21600",
        metadata=_doc(
            "Seconds before each retry of a failed webhook (±20% jitter); after the last, the "
            "delivery is dead-lettered."
        ),
    )
    delivery_lease_seconds: float = field(
        default=30.0,
        metadata=_doc("How long a claimed delivery is hidden from other senders (resent after)."),
    )
    public_url: str = field(
        default="",
        metadata=_doc(
            "The service's address as people's devices reach it, for action buttons and inbox "
            "links in Pings (e.g. `https://questions.example.com`). Empty: `http://QS_HOST:QS_PORT`."
        ),
    )
    vapid_subject: str = field(
        default="mailto:operator@localhost",
        metadata=_doc("VAPID `sub` claim of Web Push requests: a `mailto:` or `https:` contact."),
    )
    log_level: str = field(default="INFO", metadata=_doc("Python logging level."))
    access_log: bool = field(
        default=False, metadata=_doc("Log one line per HTTP request (costs throughput).")
    )
    log_format: str = field(
        default="json", metadata=_doc("`json` (one object per line) or `text` (for a terminal).")
    )
    metrics_port: int = field(
        default=0,
        metadata=_doc(
            "Also serve `/metrics` on this port (same host); the only place `worker` and `sweep` "
            "serve theirs. 0: only on the main port."
        ),
    )
    ready_requires_safe_redis: bool = field(
        default=False,
        metadata=_doc(
            "`/readyz` answers 503 while a Redis setting can lose questions (eviction policy, "
            "no persistence). Off: it answers 200 and lists the warnings."
        ),
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every field from ``QS_<FIELD>``; explicit overrides (flags) win."""
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = source.get(env_name(f.name))
            if raw is not None:
                values[f.name] = _parse(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.validate()
        return settings

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        if not 0 < self.wait_default_seconds <= self.wait_max_seconds:
            raise SettingsError("QS_WAIT_DEFAULT_SECONDS must be > 0 and <= QS_WAIT_MAX_SECONDS")
        if not 0 < self.sweep_interval_seconds <= 1.0:
            raise SettingsError("QS_SWEEP_INTERVAL_SECONDS must be > 0 and <= 1")
        if self.sweep_batch < 1 or self.retention_seconds < 1 or self.idempotency_ttl_seconds < 1:
            raise SettingsError("sweep batch, retention and idempotency TTL must be positive")
        if max(self.retention_seconds, self.idempotency_ttl_seconds) > MAX_KEEP_SECONDS:
            # Redis takes TTLs in ms up to 2**63; far below that, a create must still add them up.
            raise SettingsError("QS_RETENTION_SECONDS and QS_IDEMPOTENCY_TTL_SECONDS: at most 10 years")
        if not 1 <= self.port <= 65535:
            raise SettingsError("QS_PORT must be a TCP port")
        if self.max_body_bytes < 1024:
            raise SettingsError("QS_MAX_BODY_BYTES must be at least 1024")
        if self.body_timeout_seconds <= 0 or self.keepalive_seconds <= 0:
            raise SettingsError("QS_BODY_TIMEOUT_SECONDS and QS_KEEPALIVE_SECONDS must be positive")
        if any(c in self.key_prefix for c in "{}: ") or not self.key_prefix:
            raise SettingsError("QS_KEY_PREFIX must be non-empty and free of braces, colons, spaces")
        if self.redis_max_connections < 4:
            raise SettingsError("QS_REDIS_MAX_CONNECTIONS must be at least 4")
        if self.redis_timeout_seconds <= 0 or self.auth_cache_seconds < 0:
            raise SettingsError("timeouts must be positive and the auth cache non-negative")
        if self.events_maxlen < 100 or self.sse_heartbeat_seconds <= 0:
            raise SettingsError("QS_EVENTS_MAXLEN must be >= 100 and the SSE heartbeat positive")
        if self.sse_streams_per_principal < 1 or self.waits_per_principal < 1:
            raise SettingsError("QS_SSE_STREAMS_PER_PRINCIPAL and QS_WAITS_PER_PRINCIPAL must be >= 1")
        if self.questions_per_agent < 16:
            raise SettingsError("QS_QUESTIONS_PER_AGENT must be at least 16 (one per bucket)")
        if self.outbox_maxlen < 1000:
            raise SettingsError("QS_OUTBOX_MAXLEN must be at least 1000")
        self.validate_delivery()
        if self.wait_replicas < 0 or self.wait_timeout_ms < 1:
            raise SettingsError("QS_WAIT_REPLICAS must be >= 0 and QS_WAIT_TIMEOUT_MS >= 1")
        if self.log_format not in ("json", "text"):
            raise SettingsError("QS_LOG_FORMAT must be json or text")
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise SettingsError("QS_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
        self.validate_redis_url()
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError("QS_METRICS_PORT must be 0 or a TCP port")

    def validate_for_serving(self) -> None:
        """What only `serve` needs: `worker` and `sweep` listen on QS_METRICS_PORT alone."""
        if self.metrics_port == self.port:
            raise SettingsError("QS_METRICS_PORT must be 0 or a TCP port other than QS_PORT")

    def validate_redis_url(self) -> None:
        """Its scheme and port, so a typo is an error at start, not a traceback from redis-py."""
        if self.in_memory or self.cluster:
            return  # a cluster URL lists host:port pairs; redis-py's cluster client reads them
        try:
            parts = urlsplit(self.redis_url)
            parts.port  # noqa: B018  # read for its ValueError on a port that is not a number
        except ValueError as exc:
            raise SettingsError(f"QS_REDIS_URL: {exc}") from exc
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise SettingsError(
                "QS_REDIS_URL must be redis://, rediss://, unix://, redis+cluster:// or memory://"
            )

    def validate_delivery(self) -> None:
        try:
            for net in self.outbound_allow_nets.split(","):
                if net.strip():
                    ipaddress.ip_network(net.strip(), strict=False)
            schedule = [float(n) for n in self.webhook_retry_schedule.split(",") if n.strip()]
        except ValueError as exc:
            raise SettingsError(f"QS_OUTBOUND_ALLOW_NETS or QS_WEBHOOK_RETRY_SCHEDULE: {exc}") from exc
        if any(not 0 <= delay < math.inf for delay in schedule) or len(schedule) > 50:
            raise SettingsError("QS_WEBHOOK_RETRY_SCHEDULE: at most 50 non-negative delays")
        if not self.vapid_subject.startswith(("mailto:", "https:")):
            raise SettingsError("QS_VAPID_SUBJECT must start with mailto: or https:")
        if self.public_url and not self.public_url.startswith(("http://", "https://")):
            raise SettingsError("QS_PUBLIC_URL must be an http:// or https:// URL")
        if not 0 < self.webhook_timeout_seconds < self.delivery_lease_seconds:
            raise SettingsError("QS_WEBHOOK_TIMEOUT_SECONDS must be > 0 and < QS_DELIVERY_LEASE_SECONDS")

    @property
    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def in_memory(self) -> bool:
        return self.redis_url.startswith(MEMORY_URL)

    @property
    def cluster(self) -> bool:
        return self.redis_url.partition("://")[0] in CLUSTER_SCHEMES


def env_name(field_name: str) -> str:
    return "QS_" + field_name.upper()


def setting_docs() -> list[tuple[str, str, str]]:
    """(variable, default, description) for every setting: the README table is checked against it."""
    rows = []
    for f in fields(Settings):
        default = f.default
        shown = "" if default == "" else str(default).lower() if isinstance(default, bool) else default
        rows.append((env_name(f.name), str(shown), f.metadata["doc"]))
    return rows


def _parse(name: str, kind: Any, raw: str) -> Any:
    try:
        if kind in (bool, "bool"):
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind in (int, "int"):
            return int(raw)
        if kind in (float, "float"):
            value = float(raw)
            if not math.isfinite(value):  # nan passes every `<=` check and breaks timers later
                raise ValueError(raw)
            return value
    except ValueError as exc:
        raise SettingsError(f"{env_name(name)}={raw!r} is not a valid {kind}") from exc
    return raw
