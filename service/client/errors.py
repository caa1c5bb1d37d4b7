"""What the SDK raises: problem+json replies as typed exceptions, and the client's own failures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.client.models import Envelope


class QuestionServiceError(Exception):
    """Base of every error the SDK raises on purpose."""


class InvalidArgument(QuestionServiceError, ValueError):
    """An argument the SDK refuses before sending anything (a bad duration, target or option)."""


class ProblemError(QuestionServiceError):
    """The service refused the request with an RFC 9457 problem document."""

    def __init__(self, status: int, type: str, title: str, detail: str, body: Any = None) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status = status
        self.type = type
        self.title = title
        self.detail = detail
        self.body = body

    @property
    def slug(self) -> str:
        """The last path segment of `type` (`not-found`), or `about:blank`."""
        return self.type.rsplit("/", 1)[-1]


class BadRequest(ProblemError):
    """400: the body could not be read, or names an identity."""


class Unauthenticated(ProblemError):
    """401: no token, or the token is unknown, revoked or expired."""


class Forbidden(ProblemError):
    """403: the token's principal may see the resource but not do this."""


class NotFound(ProblemError):
    """404: no such question, or the caller may not see it."""


class Conflict(ProblemError):
    """409: the resource already exists."""


class TooLarge(ProblemError):
    """413: the body is larger than the service accepts."""


class UnsupportedMediaType(ProblemError):
    """415: the body is neither JSON nor msgpack."""


class ValidationFailed(ProblemError):
    """422: well-formed but not valid (unknown option, unknown target, reused idempotency key ...)."""


class TooManyRequests(ProblemError):
    """429: a limit of the caller (too many questions kept, long polls parked, event streams open);
    `slug` names which."""


class Unavailable(ProblemError):
    """503 (after the retries ran out): the service's store is unreachable."""


PROBLEM_CLASSES: dict[int, type[ProblemError]] = {
    400: BadRequest,
    401: Unauthenticated,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    415: UnsupportedMediaType,
    422: ValidationFailed,
    429: TooManyRequests,
    503: Unavailable,
}


def problem_error(status: int, type: str, title: str, detail: str, body: Any = None) -> ProblemError:
    return PROBLEM_CLASSES.get(status, ProblemError)(status, type, title, detail, body)


class TransportError(QuestionServiceError):
    """The service could not be reached (connection refused or reset, timeout) after every retry."""


class WaitTimeout(QuestionServiceError):
    """`wait(timeout=...)` ran out while the question was still pending; `envelope` is the last seen."""

    def __init__(self, envelope: Envelope) -> None:
        super().__init__(f"question {envelope.id} is still pending")
        self.envelope = envelope
