"""Request bodies as strict schemas: wrong types, unknown fields and out-of-range values are refused
with a message naming the field. JSON and msgpack decode to the same objects first."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from service.errors import IdentityInBody, Invalid
from service.model import (
    IDENTIFIER,
    MAX_EXPIRES_IN,
    MAX_LABEL,
    MAX_OPTIONS,
    MAX_PROMPT,
    MAX_REASON,
    MAX_TOKEN_SECONDS,
    MIN_OPTIONS,
    OPTION_ID,
)

Identifier = Annotated[str, Meta(pattern=IDENTIFIER.pattern)]
NTFY_TOKEN = r"^[\x21-\x7e]+$"
PATTERN_WORDS = {
    IDENTIFIER.pattern: (
        "of 1 to 64 characters from a-z, 0-9, '.', '_' and '-', starting with a letter or digit"
    ),
    OPTION_ID.pattern: "of 1 to 32 characters from a-z, 0-9, '_' and '-'",
    NTFY_TOKEN: "of printable ASCII characters without spaces",
}
# Fields that would name who answers: identity comes from the bearer token alone.
IDENTITY_FIELDS = frozenset(
    {"responder", "responder_id", "user", "user_id", "by", "answered_by", "principal",
     "principal_id", "from", "as", "identity", "actor", "on_behalf_of"}
)  # fmt: skip


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Option(Strict):
    id: Annotated[str, Meta(pattern=OPTION_ID.pattern)]
    label: Annotated[str, Meta(min_length=1, max_length=MAX_LABEL)]


class To(Strict):
    user: Identifier | None = None
    room: Identifier | None = None


class Ask(Strict):
    prompt: Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT)]
    options: Annotated[list[Option], Meta(min_length=MIN_OPTIONS, max_length=MAX_OPTIONS)]
    to: To
    expires_in: Annotated[int, Meta(ge=1, le=MAX_EXPIRES_IN)] | None = None
    expires_at: str | None = None
    metadata: dict[str, Any] | None = None
    webhook_url: Annotated[str, Meta(min_length=1, max_length=2048)] | None = None


class Answer(Strict):
    # The pattern of an option id: answer.lua finds the option in '|a|b|', so 'a|b' must not pass.
    option: Annotated[str, Meta(pattern=OPTION_ID.pattern)]


class Cancel(Strict):
    reason: Annotated[str, Meta(max_length=MAX_REASON)] = ""


class WaitMany(Strict):
    ids: Annotated[list[str], Meta(min_length=1, max_length=100)]
    timeout: Annotated[float, Meta(ge=0)] | None = None
    mode: Literal["any", "all"] = "any"


class NewPrincipal(Strict):
    id: Identifier
    kind: Literal["agent", "user", "admin"]
    display_name: Annotated[str, Meta(max_length=200)] = ""


class NewToken(Strict):
    expires_in: Annotated[int, Meta(ge=1, le=MAX_TOKEN_SECONDS)] | None = None


class RoomMembers(Strict):
    members: Annotated[list[Identifier], Meta(max_length=10_000)]


WebhookEvent = Literal["question.created", "question.answered", "question.expired", "question.cancelled"]


class NewWebhook(Strict):
    url: Annotated[str, Meta(min_length=1, max_length=2048)]
    events: Annotated[list[WebhookEvent], Meta(min_length=1, max_length=4)]


class PushKeys(Strict):
    p256dh: Annotated[str, Meta(min_length=1, max_length=200)]
    auth: Annotated[str, Meta(min_length=1, max_length=100)]


class PushSubscription(Strict):
    """A browser's PushSubscription.toJSON()."""

    endpoint: Annotated[str, Meta(min_length=1, max_length=2048)]
    keys: PushKeys
    expirationTime: int | None = None  # the browser's own field name


class NewChannel(Strict):
    kind: Literal["webpush", "ntfy", "webhook"]
    url: Annotated[str, Meta(min_length=1, max_length=2048)] | None = None
    # Sent as `Authorization: Bearer <token>`: printable ASCII, no spaces or line breaks.
    token: Annotated[str, Meta(min_length=1, max_length=500, pattern=NTFY_TOKEN)] | None = None
    subscription: PushSubscription | None = None

    def __post_init__(self) -> None:
        if self.kind == "webpush" and (self.subscription is None or self.url or self.token):
            raise ValueError("a webpush channel takes `subscription` only")
        if self.kind != "webpush" and (self.url is None or self.subscription is not None):
            raise ValueError(
                f"a {self.kind} channel takes `url`" + (" (and `token`)" if self.kind == "ntfy" else "")
            )
        if self.kind == "webhook" and self.token:
            raise ValueError("a webhook channel takes no `token`; it is signed instead")


T = TypeVar("T", bound=Strict)


def convert(value: Any, schema: type[T]) -> T:
    if not isinstance(value, dict):
        raise Invalid("the body must be an object")
    if schema is Answer:
        smuggled = IDENTITY_FIELDS & set(value)
        if smuggled:
            raise IdentityInBody(f"remove {sorted(smuggled)}: the responder is the token's owner")
    try:
        return msgspec.convert(value, schema)
    except msgspec.ValidationError as exc:
        raise Invalid(in_words(str(exc))) from exc


def in_words(message: str) -> str:
    """msgspec names a pattern by its regular expression; a client reads the rule instead."""
    for pattern, words in PATTERN_WORDS.items():
        message = message.replace(f"matching regex {pattern!r}", words)
    return message
