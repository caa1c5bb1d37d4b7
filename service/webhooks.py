"""Webhook endpoints that principals register for the questions they ask.

An endpoint is a URL, the event types it wants and a signing secret in the Standard Webhooks
``whsec_<base64>`` form, shown once when created or rotated. Endpoints live in the directory slot:
one hash per endpoint and one set of ids per owner.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from service.errors import Conflict, NotFound
from service.keys import Keys
from service.outbound import OutboundPolicy
from service.scripts import Code, Scripts

EVENT_TYPES = ("question.created", "question.answered", "question.expired", "question.cancelled")
MAX_PER_OWNER = 25


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


@dataclass(frozen=True, slots=True)
class Webhook:
    id: str
    owner: str
    url: str
    events: tuple[str, ...]
    secret: str
    created_ms: int

    def public(self) -> dict[str, Any]:
        """What the owner may see again: everything but the secret."""
        return {"id": self.id, "url": self.url, "events": list(self.events), "created_ms": self.created_ms}

    def with_secret(self) -> dict[str, Any]:
        return {**self.public(), "secret": self.secret}

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> Webhook:
        return cls(
            id=raw["id"],
            owner=raw["owner"],
            url=raw["url"],
            events=tuple(raw["events"].split(",")),
            secret=raw["secret"],
            created_ms=int(raw["created_ms"]),
        )


class WebhookRegistry:
    def __init__(self, redis: Redis, scripts: Scripts, keys: Keys, policy: OutboundPolicy) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.policy = policy

    async def create(self, owner: str, url: str, events: list[str]) -> Webhook:
        self.policy.check_url(url)
        hook_id, secret = "wh_" + secrets.token_hex(8), new_secret()
        ordered = tuple(sorted(set(events), key=EVENT_TYPES.index))
        reply = await self.scripts.call(
            "webhook_add",
            {"webhook": self.keys.webhook(hook_id), "owner endpoints": self.keys.webhooks_of(owner)},
            {
                "id": hook_id,
                "cap": MAX_PER_OWNER,
                "owner": owner,
                "url": url,
                "events": ",".join(ordered),
                "secret": secret,
            },
        )
        if reply.code is Code.FULL:
            raise Conflict(f"a principal may register at most {MAX_PER_OWNER} webhooks")
        return Webhook(hook_id, owner, url, ordered, secret, int(reply.value or 0))

    async def get(self, owner: str, webhook_id: str) -> Webhook:
        """The owner's endpoint; another principal's is as unknown as a missing one."""
        hook = await self.find(webhook_id)
        if hook is None or hook.owner != owner:
            raise NotFound(f"no webhook {webhook_id!r}")
        return hook

    async def find(self, webhook_id: str) -> Webhook | None:
        raw: Any = await self.redis.hgetall(self.keys.webhook(webhook_id))
        return Webhook.from_hash(raw) if raw else None

    async def of_owner(self, owner: str) -> list[Webhook]:
        ids = sorted(str(i) for i in await self.redis.smembers(self.keys.webhooks_of(owner)))
        async with self.redis.pipeline(transaction=False) as pipe:
            for webhook_id in ids:
                pipe.hgetall(self.keys.webhook(webhook_id))
            found = await pipe.execute()
        hooks = [Webhook.from_hash(raw) for raw in found if raw]
        return sorted(hooks, key=lambda h: (h.created_ms, h.id))

    async def subscribed(self, owner: str, event_type: str) -> list[Webhook]:
        return [h for h in await self.of_owner(owner) if event_type in h.events]

    async def rotate(self, owner: str, webhook_id: str) -> Webhook:
        reply = await self.scripts.call(
            "webhook_rotate",
            {"webhook": self.keys.webhook(webhook_id)},
            {"owner": owner, "secret": new_secret()},
        )
        if reply.code is not Code.APPLIED or reply.fields is None:
            raise NotFound(f"no webhook {webhook_id!r}")
        return Webhook.from_hash(reply.fields)

    async def delete(self, owner: str, webhook_id: str) -> None:
        await self.get(owner, webhook_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.webhook(webhook_id))
            pipe.srem(self.keys.webhooks_of(owner), webhook_id)
            await pipe.execute()
