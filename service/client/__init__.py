"""The Python SDK of the Question Service: `AsyncClient` (asyncio) and `Client` (blocking).

    async with AsyncClient("http://127.0.0.1:8080", token) as client:
        q = await client.ask("Deploy v2.3?", ["deploy", "abort"], to=User("alice"), timeout="10m")
        result = await q.wait()
        if result.answered("deploy"):
            ...

It talks HTTP only (httpx, msgpack): importing it never imports Redis or the server.
"""

from service.client._async import AsyncClient, AsyncQuestion
from service.client._protocol import NO_RETRY, Retry
from service.client._sync import Client, Question
from service.client.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    InvalidArgument,
    NotFound,
    ProblemError,
    QuestionServiceError,
    TooLarge,
    TooManyRequests,
    TransportError,
    Unauthenticated,
    Unavailable,
    UnsupportedMediaType,
    ValidationFailed,
    WaitTimeout,
)
from service.client.models import (
    Answer,
    Cancellation,
    Envelope,
    Option,
    Outcome,
    Page,
    Result,
    Room,
    User,
    WaitManyResult,
    parse_duration,
    parse_target,
)

__all__ = [
    "NO_RETRY",
    "Answer",
    "AsyncClient",
    "AsyncQuestion",
    "BadRequest",
    "Cancellation",
    "Client",
    "Conflict",
    "Envelope",
    "Forbidden",
    "InvalidArgument",
    "NotFound",
    "Option",
    "Outcome",
    "Page",
    "ProblemError",
    "Question",
    "QuestionServiceError",
    "Result",
    "Retry",
    "Room",
    "TooLarge",
    "TooManyRequests",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "UnsupportedMediaType",
    "User",
    "ValidationFailed",
    "WaitManyResult",
    "WaitTimeout",
    "parse_duration",
    "parse_target",
]
