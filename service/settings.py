"""The one settings dataclass, read from ``QS_*`` environment variables (or matching flags)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MEMORY_URL = "memory://"


class SettingsError(ValueError):
    """A setting has a value the service cannot run with."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class Settings:
    redis_url: str = field(
        default="redis://127.0.0.1:6379/0",
        metadata=_doc("Redis to use. `memory://` runs an in-process fakeredis that keeps nothing."),
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
        metadata=_doc("How long a terminal question stays readable before it is removed."),
    )
    idempotency_ttl_seconds: int = field(
        default=86400, metadata=_doc("How long an `Idempotency-Key` is remembered.")
    )
    max_body_bytes: int = field(
        default=64 * 1024, metadata=_doc("Largest request body accepted (413 above it).")
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
    log_level: str = field(default="INFO", metadata=_doc("Python logging level."))
    access_log: bool = field(
        default=False, metadata=_doc("Log one line per HTTP request (costs throughput).")
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
        if not 1 <= self.port <= 65535:
            raise SettingsError("QS_PORT must be a TCP port")
        if self.max_body_bytes < 1024:
            raise SettingsError("QS_MAX_BODY_BYTES must be at least 1024")
        if any(c in self.key_prefix for c in "{}: ") or not self.key_prefix:
            raise SettingsError("QS_KEY_PREFIX must be non-empty and free of braces, colons, spaces")
        if self.redis_max_connections < 4:
            raise SettingsError("QS_REDIS_MAX_CONNECTIONS must be at least 4")
        if self.redis_timeout_seconds <= 0 or self.auth_cache_seconds < 0:
            raise SettingsError("timeouts must be positive and the auth cache non-negative")
        if self.events_maxlen < 100 or self.sse_heartbeat_seconds <= 0:
            raise SettingsError("QS_EVENTS_MAXLEN must be >= 100 and the SSE heartbeat positive")
        if self.outbox_maxlen < 1000:
            raise SettingsError("QS_OUTBOX_MAXLEN must be at least 1000")

    @property
    def in_memory(self) -> bool:
        return self.redis_url.startswith(MEMORY_URL)


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
            return float(raw)
    except ValueError as exc:
        raise SettingsError(f"{env_name(name)}={raw!r} is not a valid {kind}") from exc
    return raw
