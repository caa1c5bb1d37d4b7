"""Domain errors. The HTTP layer maps each class to a status and an RFC 9457 problem, in one place."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A refusal the caller can act on. `slug` names the problem type; `detail` says why; `extra`
    becomes the problem's extension members (RFC 9457 section 3.2)."""

    slug = "error"
    title = "Error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class Malformed(ServiceError):
    slug, title = "malformed-request", "The request could not be read"


class IdentityInBody(ServiceError):
    slug, title = "identity-in-body", "Identity comes from the token, never from the request"


class Unauthenticated(ServiceError):
    slug, title = "unauthenticated", "A valid bearer token is required"


class Forbidden(ServiceError):
    slug, title = "forbidden", "Not allowed for this principal"


class NotFound(ServiceError):
    slug, title = "not-found", "No such resource"


class Conflict(ServiceError):
    slug, title = "conflict", "The resource already exists"


class Invalid(ServiceError):
    slug, title = "validation-failed", "The request is not valid"


class TooLarge(ServiceError):
    slug, title = "body-too-large", "The request body is too large"


class BodyTimeout(ServiceError):
    slug, title = "body-timeout", "The request body did not arrive in time"


class TooManyStreams(ServiceError):
    slug, title = "too-many-streams", "Too many open event streams for this principal"


class TooManyQuestions(ServiceError):
    slug, title = "too-many-questions", "This agent keeps as many questions as allowed"


class TooManyWaits(ServiceError):
    slug, title = "too-many-waits", "Too many parked waits for this principal"


class UnsupportedMediaType(ServiceError):
    slug, title = "unsupported-media-type", "Send application/json or application/msgpack"


class Unavailable(ServiceError):
    slug, title = "unavailable", "The service's store is unreachable; retry shortly"


class InvalidAction(ServiceError):
    slug, title = "invalid-action", "The action link is not valid"


class ActionUsed(ServiceError):
    slug, title = "action-used", "This action link was already used"
