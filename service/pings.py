"""Pings: notifications to the people a question waits for, with one answer button per option.

A user registers delivery channels (Web Push, ntfy, or a signed generic relay). When a question
is created, each target user's channels get a Ping; every button carries a signed action URL that
answers as that user for that one option. When the question ends, the same channels get the
resolved story under the same tag / sequence id, so the old notification stops inviting taps.

A Ping's content is built when it is sent, from the question as it is then: a Ping that goes out
after the question ended already says how it ended and carries no buttons.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.header import Header
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from cryptography.hazmat.primitives.asymmetric import ec
from py_vapid import Vapid02
from pywebpush import WebPusher
from redis.asyncio import Redis
from standardwebhooks.webhooks import Webhook as Signer

from service.auth import Directory
from service.bodies import NewChannel
from service.errors import Forbidden, Invalid, InvalidAction, NotFound
from service.keys import QUESTION_ID, Keys
from service.model import Principal, State, timestamp, to_json
from service.outbound import Attempt, OutboundPolicy, post
from service.redis_client import OUTAGES
from service.scripts import Code, Scripts
from service.webhooks import new_secret

log = logging.getLogger(__name__)

MAX_CHANNELS = 10
KINDS = ("webpush", "ntfy", "webhook")


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    """Strict: a character outside the base64url alphabet is a ValueError (binascii.Error), not
    skipped as urlsafe_b64decode skips it."""
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def check_push_keys(p256dh: str, auth: str) -> None:
    """What a browser's PushSubscription holds (RFC 8291): p256dh a P-256 public key, auth 16
    bytes. Checked when the channel is saved: a key that cannot encrypt failed every send."""
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), unb64url(p256dh))
        secret = unb64url(auth)
    except ValueError as exc:
        raise Invalid("subscription.keys.p256dh must be a base64url P-256 public key") from exc
    if len(secret) != 16:
        raise Invalid("subscription.keys.auth must be 16 bytes, base64url")


# -- server keys --------------------------------------------------------------------------------


class ServerKeys:
    """The action-signing key and the VAPID key pair, made once per deployment (HSETNX, so
    every process agrees) and cached in each process."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = f"{keys.directory}:server-keys"
        self._action: bytes | None = None
        self._vapid: Vapid02 | None = None

    async def _field(self, name: str, make: Any) -> str:
        value: Any = await self.redis.hget(self.key, name)
        if value is None:
            await self.redis.hsetnx(self.key, name, make())
            value = await self.redis.hget(self.key, name)
        return str(value)

    async def action_key(self) -> bytes:
        if self._action is None:
            self._action = unb64url(await self._field("action", lambda: b64url(secrets.token_bytes(32))))
        return self._action

    async def vapid(self) -> Vapid02:
        if self._vapid is None:

            def generate() -> str:
                fresh = Vapid02()
                fresh.generate_keys()
                return str(fresh.private_pem().decode())

            self._vapid = Vapid02.from_pem((await self._field("vapid", generate)).encode())
        return self._vapid

    async def vapid_public_key(self) -> str:
        """The application server key browsers subscribe with (uncompressed point, base64url)."""
        from cryptography.hazmat.primitives import serialization

        public = (await self.vapid()).public_key.public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        return b64url(public)


# -- action tokens ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActionClaim:
    question: str
    user: str
    option: str
    expires_ms: int


def sign_action(key: bytes, claim: ActionClaim) -> str:
    payload = b64url(
        json.dumps(
            [claim.question, claim.user, claim.option, claim.expires_ms], separators=(",", ":")
        ).encode()
    )
    return payload + "." + b64url(hmac.new(key, payload.encode(), hashlib.sha256).digest())


def verify_action(key: bytes, token: str) -> ActionClaim:
    """The claim of a token this deployment signed; InvalidAction for anything else."""
    payload, _, signature = token.partition(".")
    if len(token) > 1024 or not payload or not signature:
        raise InvalidAction("the link is malformed")
    expected = b64url(hmac.new(key, payload.encode(), hashlib.sha256).digest())
    # As bytes: compare_digest refuses str with non-ASCII characters (TypeError, a 500).
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise InvalidAction("the link's signature does not verify")
    try:
        question, user, option, expires_ms = json.loads(unb64url(payload))
    except (ValueError, TypeError) as exc:
        raise InvalidAction("the link is malformed") from exc
    # Only this deployment signs, and only real claims; checked all the same, since the question
    # id names Redis keys: a signing key that leaked must not buy a 500 or a key of its choosing.
    texts = isinstance(question, str) and isinstance(user, str) and isinstance(option, str)
    if not (texts and QUESTION_ID.match(question) and type(expires_ms) is int):
        raise InvalidAction("the link is malformed")
    return ActionClaim(question, user, option, expires_ms)


def action_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class Actions:
    """Answers through a Ping's action link: the link is the authentication, and answers at most once."""

    def __init__(
        self, redis: Redis, keys: Keys, server_keys: ServerKeys, directory: Directory, ttl_seconds: int
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.server_keys = server_keys
        self.directory = directory
        self.ttl_seconds = ttl_seconds

    async def verify(self, token: str) -> tuple[ActionClaim, Principal, bool]:
        """The verified claim, its user, and whether an earlier tap of the link has answered."""
        claim = verify_action(await self.server_keys.action_key(), token)
        user = await self.directory.principal(claim.user)
        if user is None:
            raise InvalidAction("the link's user no longer exists")
        return claim, user, bool(await self.redis.exists(self._used_key(claim, token)))

    async def mark_used(self, claim: ActionClaim, token: str) -> None:
        """Once a tap has answered (applied or not): later taps of the link are 409s. Written
        after the answer, never before it, so a tap that fails or is cut off leaves nothing to
        undo (a mark written first was left behind when Redis ran the SET but its reply was
        lost). Best effort: the tap did answer, and a link left unmarked re-runs the same keyed
        answer when tapped again, which changes nothing."""
        try:
            await self.redis.set(self._used_key(claim, token), "1", ex=self.ttl_seconds)
        except OUTAGES as exc:
            log.warning("could not mark action link of %s as used: %r", claim.question, exc)

    def _used_key(self, claim: ActionClaim, token: str) -> str:
        return self.keys.action_used(claim.question, action_digest(token))


# -- channels -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Channel:
    user: str
    name: str
    kind: str
    url: str
    token: str = ""  # ntfy access token
    secret: str = ""  # relay signing secret (whsec_)
    p256dh: str = ""  # Web Push subscription keys
    auth: str = ""

    @property
    def ref(self) -> str:
        return f"ch:{self.user}/{self.name}"

    def public(self) -> dict[str, Any]:
        """What the owner may see again: never a token, secret or subscription key."""
        return {"name": self.name, "kind": self.kind, "url": self.url}

    def to_json(self) -> str:
        return json.dumps(
            [self.kind, self.url, self.token, self.secret, self.p256dh, self.auth], separators=(",", ":")
        )

    @classmethod
    def from_json(cls, user: str, name: str, raw: str) -> Channel:
        kind, url, token, secret, p256dh, auth = json.loads(raw)
        return cls(user, name, kind, url, token, secret, p256dh, auth)


def parse_ref(ref: str) -> tuple[str, str]:
    user, _, name = ref.removeprefix("ch:").partition("/")
    return user, name


class ChannelRegistry:
    def __init__(self, redis: Redis, scripts: Scripts, keys: Keys, policy: OutboundPolicy) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.policy = policy

    def _key(self, user: str) -> str:
        return f"{self.keys.principal(user)}:channels"

    async def put(self, user: str, name: str, body: NewChannel) -> Channel:
        channel = self._validated(user, name, body)
        reply = await self.scripts.call(
            "channel_put",
            {"channels": self._key(user)},
            {"name": name, "channel": channel.to_json(), "cap": MAX_CHANNELS},
        )
        if reply.code is Code.FULL:
            raise Invalid(f"a user may register at most {MAX_CHANNELS} channels")
        return channel

    def _validated(self, user: str, name: str, body: NewChannel) -> Channel:
        if body.subscription is not None:
            sub = body.subscription
            self.policy.check_url(sub.endpoint)
            check_push_keys(sub.keys.p256dh, sub.keys.auth)
            return Channel(user, name, body.kind, sub.endpoint, p256dh=sub.keys.p256dh, auth=sub.keys.auth)
        assert body.url is not None  # NewChannel checked the combination
        self.policy.check_url(body.url)
        if body.kind == "ntfy":
            return Channel(user, name, body.kind, body.url, token=body.token or "")
        return Channel(user, name, body.kind, body.url, secret=new_secret())

    async def of_user(self, user: str) -> list[Channel]:
        return await self.of_users([user])

    async def of_users(self, users: Sequence[str]) -> list[Channel]:
        """Every channel of these users, in their order: one pipeline, not a round trip each
        (a room of thousands is Pinged from one fan-out step)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for user in users:
                pipe.hgetall(self._key(user))
            found: list[Any] = await pipe.execute()
        return [
            Channel.from_json(user, name, raw)
            for user, channels in zip(users, found, strict=True)
            for name, raw in sorted(channels.items())
        ]

    async def get(self, user: str, name: str) -> Channel | None:
        raw: Any = await self.redis.hget(self._key(user), name)
        return None if raw is None else Channel.from_json(user, name, raw)

    async def delete(self, user: str, name: str) -> None:
        if not await self.redis.hdel(self._key(user), name):
            raise NotFound(f"no channel {name!r}")


def require_user(kind: str) -> None:
    if kind != "user":
        raise Forbidden("delivery channels belong to users")


# -- what a Ping says ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ping:
    """A question as a notification: the text, and the buttons while it is pending."""

    question: str
    title: str
    body: str
    link: str
    buttons: list[dict[str, str]]  # {"option", "label", "url"}
    resolved: bool
    envelope: dict[str, Any]


def story(fields: dict[str, str]) -> tuple[str, str]:
    """(title, body) of a resolved question, as the web inbox says it."""
    state = State.of(fields["state"])
    labels = {o["id"]: o["label"] for o in json.loads(fields["options"])}
    if state is State.ANSWERED:
        return f"Answered: {labels.get(fields['ans_option'], fields['ans_option'])}", (
            f"{fields['ans_by']} answered {labels.get(fields['ans_option'])!s}: {fields['prompt']}"
        )
    if state is State.CANCELLED:
        reason = f": {fields['cancel_reason']}" if fields.get("cancel_reason") else ""
        return "Cancelled", f"Cancelled by {fields['cancel_by']}{reason}. {fields['prompt']}"
    return "Expired", f"Expired without an answer: {fields['prompt']}"


async def build_ping(
    fields: dict[str, str], user: str, public_url: str, action_key: bytes, envelope: dict[str, Any]
) -> Ping:
    link = f"{public_url}/#question={fields['id']}"
    if State.of(fields["state"]) is not State.PENDING:
        title, body = story(fields)
        return Ping(fields["id"], title, body, link, [], True, envelope)
    buttons = []
    for option in json.loads(fields["options"]):
        claim = ActionClaim(fields["id"], user, option["id"], int(fields["expires_ms"]))
        url = f"{public_url}/v1/actions/{sign_action(action_key, claim)}"
        buttons.append({"option": option["id"], "label": option["label"], "url": url})
    title = f"{fields['asker']} asks"
    return Ping(fields["id"], title, fields["prompt"], link, buttons, False, envelope)


def header_text(text: str) -> str:
    """ASCII as it is; anything else RFC 2047-encoded, which ntfy accepts in every header. The
    encoded words are joined by spaces: Header folds them with a line break after ~76
    characters, and aiohttp refuses a header value holding one (the Ping was never sent)."""
    return text if text.isascii() else Header(text, "utf-8").encode(linesep=" ")


def ntfy_request(channel: Channel, ping: Ping) -> tuple[bytes, dict[str, str]]:
    """ntfy's HTTP publish API: the same X-Sequence-ID replaces the notification in place."""
    headers = {
        "X-Sequence-ID": ping.question,
        "Title": header_text(ping.title),
        "Click": ping.link,
        "Tags": "white_check_mark" if ping.resolved else "question",
    }
    if ping.buttons:
        actions = "; ".join(
            f'http, "{b["label"].replace(chr(34), chr(39))}", {b["url"]}, method=POST, clear=true'
            for b in ping.buttons[:3]  # ntfy shows at most three buttons
        )
        headers["Actions"] = header_text(actions)
    if channel.token:
        headers["Authorization"] = f"Bearer {channel.token}"
    return ping.body.encode(), headers


def webpush_payload(ping: Ping) -> bytes:
    """What the service worker shows: the same `tag` for the Ping and its resolution."""
    return to_json(
        {
            "tag": ping.question,
            "title": ping.title,
            "body": ping.body,
            "url": ping.link,
            "resolved": ping.resolved,
            "actions": [{"action": b["option"], "title": b["label"], "url": b["url"]} for b in ping.buttons],
        }
    )


async def webpush_request(
    channel: Channel, ping: Ping, vapid: Vapid02, subject: str
) -> tuple[bytes, dict[str, str]]:
    pusher = WebPusher({"endpoint": channel.url, "keys": {"p256dh": channel.p256dh, "auth": channel.auth}})
    encoded = pusher.encode(webpush_payload(ping), "aes128gcm")
    parts = urlsplit(channel.url)
    claims = {"sub": subject, "aud": f"{parts.scheme}://{parts.netloc}", "exp": int(time.time()) + 12 * 3600}
    headers = {
        **vapid.sign(claims),
        "Content-Encoding": "aes128gcm",
        "TTL": "86400",
        "Topic": "q" + ping.question,
        "Urgency": "normal" if ping.resolved else "high",
    }
    return bytes(encoded["body"]), headers


def relay_request(channel: Channel, ping: Ping, delivery: str) -> tuple[bytes, dict[str, str]]:
    """A generic relay gets a Standard Webhooks event, signed with the channel's secret."""
    data: dict[str, Any] = {"question": ping.envelope, "inbox_url": ping.link}
    if ping.buttons:
        data["actions"] = ping.buttons
    kind = "question.resolved" if ping.resolved else "question.created"
    body = to_json({"type": kind, "timestamp": timestamp(int(time.time() * 1000)), "data": data}).decode()
    now = datetime.now(UTC)
    headers = {
        "content-type": "application/json",
        "webhook-id": delivery,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Signer(channel.secret).sign(delivery, now, body),
    }
    return body.encode(), headers


async def send_ping(
    session: aiohttp.ClientSession,
    policy: OutboundPolicy,
    channel: Channel,
    ping: Ping,
    *,
    delivery: str,
    server_keys: ServerKeys,
    vapid_subject: str,
    timeout: float,
) -> Attempt:
    vapid = await server_keys.vapid() if channel.kind == "webpush" else None
    try:
        if vapid is not None:
            body, headers = await webpush_request(channel, ping, vapid, vapid_subject)
        elif channel.kind == "ntfy":
            body, headers = ntfy_request(channel, ping)
        else:
            body, headers = relay_request(channel, ping, delivery)
    except Exception as exc:  # the channel's stored details cannot make a request: a failed attempt
        return Attempt(0, f"cannot build the request: {type(exc).__name__}: {exc}"[:300], 0)
    return await post(session, policy, channel.url, body, headers, timeout)
