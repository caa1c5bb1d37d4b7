"""RFC 9457 problem+json: the one error middleware, and the one map from domain error to status."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from redis.exceptions import ResponseError

from service import errors
from service.http.codec import PROBLEM
from service.model import to_json
from service.redis_client import OUTAGES, refused_for_now

log = logging.getLogger(__name__)
PROBLEM_BASE = "https://question-service.invalid/problems/"

STATUS: dict[type[errors.ServiceError], int] = {
    errors.Malformed: 400,
    errors.IdentityInBody: 400,
    errors.Unauthenticated: 401,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.ActionUsed: 409,
    errors.InvalidAction: 403,
    errors.BodyTimeout: 408,
    errors.TooLarge: 413,
    errors.UnsupportedMediaType: 415,
    errors.Invalid: 422,
    errors.TooManyStreams: 429,
    errors.TooManyWaits: 429,
    errors.TooManyQuestions: 429,
    errors.Unavailable: 503,
}
STORE_DOWN = OUTAGES


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    slug: str | None = None,
    headers: dict[str, str] | None = None,
    members: dict[str, Any] | None = None,
) -> web.Response:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + slug if slug else "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
    } | (members or {})
    response = web.Response(body=to_json(body), status=status, headers=headers)
    response.content_type = PROBLEM
    return response


def from_service_error(exc: errors.ServiceError) -> web.Response:
    status = STATUS[type(exc)]
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="question-service"'
    if status == 503:
        headers["Retry-After"] = "1"
    return problem(status, exc.title, exc.detail, slug=exc.slug, headers=headers, members=exc.extra)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.ServiceError as exc:
        return from_service_error(exc)
    except web.HTTPRequestEntityTooLarge:
        return from_service_error(errors.TooLarge("the request body is too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return problem(exc.status, exc.reason, exc.text or exc.reason, headers=_allow(exc))
    except STORE_DOWN as exc:
        return store_down(request, exc)
    except ResponseError as exc:
        if refused_for_now(exc):  # MISCONF, NOREPLICAS, BUSY: no class of their own
            return store_down(request, exc)
        return unhandled(request)
    except Exception:
        return unhandled(request)


def store_down(request: web.Request, exc: Exception) -> web.Response:
    log.warning("store unavailable on %s %s: %r", request.method, request.path, exc)
    return from_service_error(errors.Unavailable("Redis is unreachable or not ready"))


def unhandled(request: web.Request) -> web.Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return problem(500, "Internal Server Error", "an unexpected error was logged")


def _allow(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}
