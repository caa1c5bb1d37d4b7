"""Logs: one line per event, JSON (default) or text, with the request id of the request in progress.

The request middleware gives every request an id (the caller's `X-Request-Id` when it is short and
plain, else a new one), echoes it in the response, times the request for /metrics and, with
QS_ACCESS_LOG, writes one access line: request id, principal id, question id, route template,
status, outcome and latency. It never logs a header, a body, a query string or the raw path (a
token can be a path segment of DELETE /v1/admin/tokens/{ref}); and every line passes a redaction
that masks anything shaped like a token, in case some other message carries one.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import re
import secrets
import sys
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from service.keys import QUESTION_ID as QUESTION_ID_PATTERN
from service.metrics import UNMATCHED, Metrics
from service.settings import Settings

REQUEST_ID_HEADER = "X-Request-Id"
_INCOMING_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}\Z")
_ID_PREFIX = secrets.token_hex(4)
_id_numbers = itertools.count(1)
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

REQUEST_ID = web.RequestKey("request_id", str)
QUESTION_ID = web.RequestKey("log_question_id", str)
OUTCOME = web.RequestKey("log_outcome", str)
ACCESS = logging.getLogger("service.access")

# Bearer credentials anywhere in a message: service tokens by their shape, any `Bearer x`.
_SECRETS = [
    (re.compile(r"\b(qs_[0-9a-f]{12})_[A-Za-z0-9_-]{20,}"), r"\1_[redacted]"),
    (re.compile(r"(?i)\b(bearer\s+)\S+"), r"\1[redacted]"),
    # A Ping's action link is its own credential (the path of POST /v1/actions/{token}).
    (re.compile(r"(/v1/actions/)[^\s/?#\"']+"), r"\1[redacted]"),
]
# Fields an access line (or any record, through `extra=`) may carry, in output order.
EXTRA_FIELDS = (
    "request_id",
    "principal",
    "question_id",
    "method",
    "route",
    "status",
    "outcome",
    "latency_ms",
)


def new_request_id() -> str:
    """A per-process random prefix and a counter: unique without a system call per request."""
    return f"{_ID_PREFIX}{next(_id_numbers):x}"


def request_id_of(request: web.Request) -> str:
    incoming = request.headers.get(REQUEST_ID_HEADER)
    if incoming is not None and _INCOMING_ID.match(incoming):
        return incoming
    return new_request_id()


def note(request: web.Request, *, outcome: str | None = None, question_id: str | None = None) -> None:
    """Handlers name what happened (outcome) and the question concerned, for the access line."""
    if outcome is not None:
        request[OUTCOME] = outcome
    if question_id is not None:
        request[QUESTION_ID] = question_id


# -- formatting ---------------------------------------------------------------------------------


class Redactor:
    def __init__(self, literals: tuple[str, ...] = ()) -> None:
        # Configured secrets (QS_ADMIN_TOKEN) are masked literally; short ones would mask noise.
        self.literals = tuple(s for s in literals if len(s) >= 8)

    def __call__(self, text: str) -> str:
        for pattern, replacement in _SECRETS:
            text = pattern.sub(replacement, text)
        for literal in self.literals:
            text = text.replace(literal, "[redacted]")
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the request id in progress, any known
    extra field, and exc (the traceback) when there is one."""

    def __init__(self, redact: Redactor | None = None) -> None:
        super().__init__()
        self.redact = redact or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": self.redact(record.getMessage()),
        }
        _add_context(line, record)
        if record.exc_info:
            line["exc"] = self.redact(self.formatException(record.exc_info))
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`ts LEVEL logger msg key=value ...`, for a terminal."""

    def __init__(self, redact: Redactor | None = None) -> None:
        super().__init__()
        self.redact = redact or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        context: dict[str, Any] = {}
        _add_context(context, record)
        pairs = "".join(f" {k}={v}" for k, v in context.items())
        text = f"{_timestamp(record.created)} {record.levelname} {record.name} {record.getMessage()}{pairs}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return self.redact(text)


def _add_context(line: dict[str, Any], record: logging.LogRecord) -> None:
    request_id = current_request_id.get()
    if request_id is not None:
        line["request_id"] = request_id
    for name in EXTRA_FIELDS:
        value = record.__dict__.get(name)
        if value is not None:
            line[name] = value


def _timestamp(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class UnreadableRequests(logging.Filter):
    """aiohttp logs a request its HTTP parser cannot read (a header line over 8,190 bytes, a
    port scanner's bytes) at ERROR with a traceback. That is the client's mistake, answered with
    a 400, not the service's: one WARNING line without the traceback, so a scanner cannot fill
    the error log or page anyone."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            said = record.getMessage()
            record.msg = "%s: unreadable HTTP request, answered %s: %.200s"
            record.args = (said, exc.code, exc.message)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def configure_logging(settings: Settings, stream: Any = None) -> logging.Handler:
    """The root logger writes to stderr (or `stream`) in QS_LOG_FORMAT at QS_LOG_LEVEL."""
    redact = Redactor((settings.admin_token,))
    handler = logging.StreamHandler(stream or sys.stderr)
    fmt = JsonFormatter(redact) if settings.log_format == "json" else TextFormatter(redact)
    handler.setFormatter(fmt)
    handler.addFilter(UnreadableRequests())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    return handler


# -- the request middleware ---------------------------------------------------------------------


def request_middleware(
    metrics: Metrics, *, access_log: bool, principal_key: web.RequestKey[Any]
) -> Middleware:
    """Outermost middleware: request id, /metrics counters, and the access line."""

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        request_id = request[REQUEST_ID] = request_id_of(request)
        token = current_request_id.set(request_id)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            if not response.prepared:
                response.headers[REQUEST_ID_HEADER] = request_id
            if access_log and status >= 400 and OUTCOME not in request:
                request[OUTCOME] = problem_slug(response) or outcome_of_status(status)
            return response
        except web.HTTPException as exc:  # redirects and such, which the problem layer lets by
            status = exc.status
            exc.headers[REQUEST_ID_HEADER] = request_id
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away first (nginx's convention)
            raise
        finally:
            elapsed = time.perf_counter() - started
            route = route_of(request)
            if status == 405 and route is UNMATCHED:
                route = await route_refusing_method(request)
            metrics.http_done(route, request.method, status, elapsed)
            if access_log:
                log_access(request, route, status, elapsed, principal_key)
            current_request_id.reset(token)

    return observe


def route_of(request: web.Request) -> str:
    """The route's path template (`/v1/questions/{id}`), never the raw path."""
    resource = request.match_info.route.resource
    return UNMATCHED if resource is None else resource.canonical


async def route_refusing_method(request: web.Request) -> str:
    """A 405's route: aiohttp's match info keeps no resource when only the method was wrong,
    but the path did match one, and "unmatched" would hide which route is called wrongly."""
    for resource in request.app.router.resources():
        match, allowed = await resource.resolve(request)
        if match is None and allowed:
            return resource.canonical
    return route_of(request)


def log_access(
    request: web.Request, route: str, status: int, seconds: float, principal_key: web.RequestKey[Any]
) -> None:
    principal = request.get(principal_key)
    question_id = request.get(QUESTION_ID)
    if question_id is None and route.startswith("/v1/questions/{id}"):
        raw = request.match_info.get("id", "")
        question_id = raw if QUESTION_ID_PATTERN.match(raw) else None  # never log arbitrary input
    ACCESS.info(
        "%s %s %d",
        request.method,
        route,
        status,
        extra={
            "principal": getattr(principal, "id", None),
            "question_id": question_id,
            "method": request.method,
            "route": route,
            "status": status,
            "outcome": request.get(OUTCOME) or outcome_of_status(status),
            "latency_ms": round(seconds * 1000, 3),
        },
    )


def problem_slug(response: web.StreamResponse) -> str | None:
    """The last segment of a problem document's type (`not-found`), for the access line."""
    if not isinstance(response, web.Response) or not response.content_type.startswith("application/problem"):
        return None
    body = response.body
    if not isinstance(body, bytes):
        return None
    try:
        kind = json.loads(body).get("type", "")
    except ValueError:
        return None  # not JSON after all: the status names the outcome instead
    slug = str(kind).rsplit("/", 1)[-1]
    return None if slug in ("", "about:blank") else slug


def outcome_of_status(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 499:
        return "client_gone"
    return f"http_{status}"
