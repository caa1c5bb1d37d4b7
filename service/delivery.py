"""Outgoing webhooks and Pings, at least once: outbox -> delivery records -> POSTs with retries.

Two loops, any number of each across processes (docs/delivery.md):
- the fan-out (an outbox consumer group "webhooks") turns each committed event into one delivery
  record per target: each subscribed endpoint of the question's asker, the question's own
  webhook_url, and each Ping channel of the people it waits for. Then it acknowledges the outbox
  entry. A delivery's id is derived from the outbox entry and the target, so a fan-out re-run
  after a crash finds the records it already made (deliver_enqueue.lua) instead of doubling them.
- the sender leases due deliveries (deliver_claim.lua), POSTs each (webhooks signed per Standard
  Webhooks; Pings built from the question as it is at send time), and records the attempt
  (deliver_settle.lua): delivered on a 2xx; otherwise due again after the next step of the retry
  schedule, or dead-lettered after the last. A sender killed between its POST and its record lets
  the lease run out, and the delivery is sent again with the same webhook-id, which is how
  receivers deduplicate.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import random
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from redis.asyncio import Redis
from redis.exceptions import RedisError
from standardwebhooks.webhooks import Webhook as Signer

from service.backoff import Backoff, keep_running, stop_tasks
from service.errors import NotFound
from service.keys import BUCKETS, Keys, bucket_of
from service.model import envelope, timestamp, to_json
from service.outbound import Attempt, OutboundPolicy, new_session, parse_nets, post
from service.outbox import OutboxConsumer, Read
from service.pings import ChannelRegistry, ServerKeys, build_ping, parse_ref, send_ping
from service.scripts import Code, Reply, Scripts, pairs_to_fields
from service.settings import Settings
from service.store import QuestionStore, new_call_id
from service.webhooks import WebhookRegistry

log = logging.getLogger(__name__)
INDEX_CAP = 1000
HISTORY_CAP = 20
CLAIM_BATCH = 50
SEND_CONCURRENCY = 32


def delivery_id(question_id: str, outbox_entry: str, target: str) -> str:
    """The same for every fan-out of one event to one target, and only for it. The question id
    is in it because entry ids are unique only within one bucket's outbox: two buckets append
    in the same millisecond under the same id (different questions, one webhook-id, otherwise)."""
    key = f"{question_id}|{outbox_entry}|{target}"
    return "msg_" + hashlib.sha256(key.encode()).hexdigest()[:32]


def webhook_body(event_type: str, committed_ms: int, question: dict[str, Any]) -> str:
    """The payload: the event type, when it was committed, and the envelope a fetch returns."""
    data = {"type": event_type, "timestamp": timestamp(committed_ms), "data": question}
    return to_json(data).decode()


def signed_headers(delivery: str, secret: str, body: str, now: datetime) -> dict[str, str]:
    """Standard Webhooks headers; the signature covers `id.timestamp.body`."""
    return {
        "content-type": "application/json",
        "user-agent": "question-service-webhooks",
        "webhook-id": delivery,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Signer(secret).sign(delivery, now, body),
    }


# A settled record's status -> the attempt's outcome in /metrics.
SETTLED_AS = {"delivered": "delivered", "pending": "retry", "dead": "dead"}


def parse_schedule(raw: str) -> tuple[float, ...]:
    """`QS_WEBHOOK_RETRY_SCHEDULE`: seconds before each retry, comma-separated."""
    return tuple(float(part) for part in raw.split(",") if part.strip())


@dataclass(frozen=True, slots=True)
class Delivery:
    id: str
    bucket: int
    webhook: str
    url: str
    type: str
    body: str
    attempts: int
    status: str
    question: str

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> Delivery:
        return cls(
            raw["id"],
            bucket_of(raw["question"]),
            raw["webhook"],
            raw["url"],
            raw["type"],
            raw["body"],
            int(raw["attempts"]),
            raw["status"],
            raw["question"],
        )


def public_delivery(raw: dict[str, str]) -> dict[str, Any]:
    """A delivery record as the API shows it (never the secret, which it does not hold)."""
    return {
        "id": raw["id"],
        "webhook_id": raw["webhook"] or None,
        "type": raw["type"],
        "question_id": raw["question"],
        "status": raw["status"],
        "attempts": int(raw["attempts"]),
        "created_at": timestamp(raw["created_ms"]),
        "next_attempt_at": timestamp(raw["next_ms"]) if raw.get("next_ms") else None,
        "history": [
            {
                "at": timestamp(a["at_ms"]),
                "status": a["status"] or None,
                "error": a["error"] or None,
                "duration_ms": a["duration_ms"],
            }
            for a in json.loads(raw["history"] or "[]")
        ],
    }


class DeliveryStore:
    """Delivery records over the deliver_*.lua scripts; keys built here from Keys."""

    def __init__(self, redis: Redis, scripts: Scripts, keys: Keys, retention_ms: int) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.retention_ms = retention_ms

    async def enqueue_many(
        self, event: dict[str, str], targets: Sequence[tuple[str, str, str, str]]
    ) -> list[bool]:
        """One delivery record per (target, url, body, delivery id) of one event, in one batch;
        whether each was new (False: a fan-out re-run had made it)."""
        b = bucket_of(event["id"])
        calls = [self._enqueue_call(b, event, *target) for target in targets]
        replies = await self.scripts.call_many("deliver_enqueue", calls)
        return [reply.code is Code.CREATED for reply in replies]

    def _enqueue_call(
        self, b: int, event: dict[str, str], hook_id: str, url: str, body: str, did: str
    ) -> tuple[dict[str, str], dict[str, str | int]]:
        keys = {
            "delivery": self.keys.delivery(b, did),
            "due": self.keys.deliveries_due(b),
            "endpoint index": self.keys.webhook_deliveries(b, hook_id or "-"),
        }
        args: dict[str, str | int] = {
            "id": did,
            "webhook": hook_id,
            "url": url,
            "type": event["type"],
            "question": event["id"],
            "body": body,
            "index cap": INDEX_CAP,
            "index ttl": self.retention_ms,
        }
        return keys, args

    async def claim(self, b: int, lease_ms: int, count: int = CLAIM_BATCH) -> list[Delivery]:
        reply = await self.scripts.call(
            "deliver_claim",
            {
                "due": self.keys.deliveries_due(b),
                "dead letters": self.keys.dead_letters(b),
                "last claim": self.keys.last_claim(b),
            },
            {"lease": lease_ms, "count": count, "retention": self.retention_ms, "call id": new_call_id()},
        )
        if reply.code is not Code.APPLIED or not reply.value:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for did in reply.value.split():
                pipe.hgetall(self.keys.delivery(b, did))
            found = await pipe.execute()
        return [Delivery.from_hash(raw) for raw in found if raw]

    async def settle(self, delivery: Delivery, attempt: Attempt, delays_ms: Sequence[int]) -> Reply:
        """Record the attempt; `delays_ms`: the wait before each retry (after attempt 1, 2, ...),
        empty when retrying cannot help. The script picks the step by the recorded count."""
        b = delivery.bucket
        reply = await self.scripts.call(
            "deliver_settle",
            self._record_keys(b, delivery.id),
            {
                "id": delivery.id,
                "ok": "1" if attempt.ok else "0",
                "status": attempt.status,
                "error": attempt.error,
                "duration": attempt.duration_ms,
                "retry delays": " ".join(str(delay) for delay in delays_ms),
                "retention": self.retention_ms,
                "history cap": HISTORY_CAP,
                "call id": new_call_id(),
            },
        )
        return reply

    async def replay(self, did: str) -> dict[str, Any]:
        """Put a dead-lettered delivery back in the queue; NotFound unless it is dead."""
        call_id = new_call_id()
        for b in range(BUCKETS):
            reply = await self.scripts.call(
                "deliver_replay", self._record_keys(b, did), {"id": did, "call id": call_id}
            )
            if reply.code is Code.NOT_FOUND:
                continue
            if reply.code is not Code.APPLIED or reply.fields is None:
                raise NotFound(f"delivery {did!r} is not dead-lettered")
            return public_delivery(reply.fields)
        raise NotFound(f"no delivery {did!r}")

    async def for_webhook(self, hook_id: str, limit: int) -> list[dict[str, Any]]:
        """The endpoint's newest deliveries across buckets, newest first."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in range(BUCKETS):
                pipe.zrange(
                    self.keys.webhook_deliveries(b, hook_id), 0, limit - 1, desc=True, withscores=True
                )
            per_bucket = await pipe.execute()
        newest = sorted(
            ((score, b, did) for b, found in enumerate(per_bucket) for did, score in found), reverse=True
        )[:limit]
        return await self._records([(b, did) for _, b, did in newest])

    async def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in range(BUCKETS):
                pipe.xrevrange(self.keys.dead_letters(b), count=limit)
            per_bucket = await pipe.execute()
        newest = sorted(
            ((entry_id, b, fields["id"]) for b, found in enumerate(per_bucket) for entry_id, fields in found),
            key=lambda e: tuple(int(p) for p in e[0].split("-")),
            reverse=True,
        )[:limit]
        return await self._records([(b, did) for _, b, did in newest])

    async def _records(self, refs: Sequence[tuple[int, str]]) -> list[dict[str, Any]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for b, did in refs:
                pipe.hgetall(self.keys.delivery(b, did))
            found = await pipe.execute()
        return [public_delivery(raw) for raw in found if raw]

    def _record_keys(self, b: int, did: str) -> dict[str, str]:
        return {
            "delivery": self.keys.delivery(b, did),
            "due": self.keys.deliveries_due(b),
            "dead letters": self.keys.dead_letters(b),
        }


@dataclass(frozen=True)
class PingContext:
    """What sending a Ping needs beyond a webhook: the channels, the keys, the public address."""

    redis: Redis
    keys: Keys
    channels: ChannelRegistry
    server_keys: ServerKeys
    public_url: str
    vapid_subject: str
    retention_seconds: int
    questions: QuestionStore  # reads expire an overdue question, so a Ping shows no stale buttons


class OutboxFanout(OutboxConsumer):
    """Outbox events -> delivery records: one per subscribed webhook endpoint of the question's
    asker, and one Ping per channel of each user the question waits for (created) or was shown
    to (resolved: the Ping is withdrawn)."""

    group = "webhooks"
    label = "delivery fan-out"

    def __init__(
        self,
        deliveries: DeliveryStore,
        registry: WebhookRegistry,
        pings: PingContext,
        *,
        blocking: Redis | None = None,
    ) -> None:
        super().__init__(pings.redis, pings.keys, blocking=blocking)
        self.deliveries = deliveries
        self.registry = registry
        self.pings = pings

    async def process(self, read: Read) -> None:
        for _outbox, entries in read:
            for entry_id, fields in entries:
                if fields:  # empty: trimmed away before it was read
                    await self._fan_out(entry_id, fields)

    async def _fan_out(self, entry_id: str, event: dict[str, str]) -> None:
        question = pairs_to_fields(json.loads(event["question"]))
        # (target, url) of every webhook this event goes to: the asker's subscribed endpoints,
        # and the question's own URL for its terminal events. All carry the same body.
        targets = [(h.id, h.url) for h in await self.registry.subscribed(question["asker"], event["type"])]
        if question.get("hook_url") and event["type"] != "question.created":
            targets.append((f"q:{question['id']}", question["hook_url"]))
        records = []
        if targets:
            body = webhook_body(event["type"], int(entry_id.split("-")[0]), envelope(question))
            records = [
                (target, url, body, delivery_id(question["id"], entry_id, target)) for target, url in targets
            ]
        refs = await self._ping_refs(event["type"], question)
        records += [(ref, "", "", delivery_id(question["id"], entry_id, ref)) for ref in refs]
        if records:
            await self.deliveries.enqueue_many(event, records)

    async def _ping_refs(self, event_type: str, question: dict[str, str]) -> list[str]:
        """The channels to Ping: on creation, every channel of every target user (remembered);
        on the end, the remembered ones, so a user who left the room still sees it end."""
        pinged = self.keys.pinged(question["id"])
        if event_type != "question.created":
            return sorted(str(ref) for ref in await self.redis.smembers(pinged))
        users = [question["to_id"]]
        if question["to_kind"] == "room":
            users = sorted(
                str(u) for u in await self.redis.smembers(self.keys.room_members(question["to_id"]))
            )
        refs = [channel.ref for channel in await self.pings.channels.of_users(users)]
        if refs:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.sadd(pinged, *refs)
                # Read again when the question ends, which can be up to its deadline away.
                ends_by_ms = int(question["expires_ms"]) + self.pings.retention_seconds * 1000
                pipe.pexpireat(pinged, ends_by_ms)
                await pipe.execute()
        return refs


async def _all_of(sends: Iterable[Awaitable[None]]) -> None:
    """Every send run to its end, then the first failure raised and the others logged. A plain
    gather raised at the first and let the rest run on unwatched, their failures dropped."""
    outcomes = await asyncio.gather(*sends, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    for failure in failures[1:]:
        log.warning("another send of the same pass failed too: %r", failure)
    if failures:
        raise failures[0]


class DeliverySender:
    """Leases due deliveries from every bucket, sends them, records each attempt."""

    def __init__(
        self,
        deliveries: DeliveryStore,
        registry: WebhookRegistry,
        policy: OutboundPolicy,
        pings: PingContext,
        *,
        schedule: Sequence[float],
        timeout: float,
        lease_seconds: float,
        poll_seconds: float = 0.2,
    ) -> None:
        self.deliveries = deliveries
        self.registry = registry
        self.policy = policy
        self.pings = pings
        self.schedule = tuple(schedule)
        self.timeout = timeout
        self.lease_ms = round(lease_seconds * 1000)
        self.poll_seconds = poll_seconds
        self.session: aiohttp.ClientSession | None = None
        self.limit = asyncio.Semaphore(SEND_CONCURRENCY)
        self.claim_budget = claim_budget(lease_seconds, timeout)
        self._first_bucket = 0
        self.sent = 0
        # (target kind webhook|ping, outcome delivered|retry|dead) -> attempts, for /metrics
        self.attempts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.stopping = False
        self._sending: set[asyncio.Task[None]] = set()  # claimed, not yet recorded
        self._failures: list[BaseException] = []

    async def run(self) -> None:
        await keep_running("delivery sender", self._send_forever, lambda: self.stopping)

    async def aclose(self) -> None:
        await stop_tasks(list(self._sending))  # their leases run out; another send takes them
        if self.session is not None:
            await self.session.close()

    async def _send_forever(self, backoff: Backoff) -> None:
        """Claim as sends finish, never waiting for a whole pass: one slow receiver held up
        every other delivery of the process for up to its timeout, again on each retry."""
        while not self.stopping:
            self._raise_failed_sends()
            started = await self._start_due()
            backoff.succeeded()
            if not started:
                await asyncio.sleep(self.poll_seconds)

    async def _start_due(self) -> int:
        """Claim what is due while fewer than the claim budget are claimed and unrecorded (so
        each is sent and recorded within its lease), and start sending each on its own."""
        room = self.claim_budget - len(self._sending)
        due = await self._claim(room) if room > 0 else []
        for delivery in due:
            task = asyncio.create_task(self._send(delivery))
            self._sending.add(task)
            task.add_done_callback(self._recorded)
        return len(due)

    def _recorded(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            self._failures.append(failure)

    def _raise_failed_sends(self) -> None:
        """A send that failed (Redis, say) reaches the loop's backoff, as a failed claim does."""
        failures, self._failures = self._failures, []
        for failure in failures[1:]:
            log.warning("another send failed too: %r", failure)
        if failures:
            raise failures[0]

    async def send_due(self) -> int:
        """One pass, waited for: claim what is due up to the claim budget, send it all, and
        return how many were sent."""
        due = await self._claim(self.claim_budget)
        await _all_of(self._send(d) for d in due)
        return len(due)

    async def _claim(self, budget: int) -> list[Delivery]:
        """Up to `budget` due deliveries, bucket after bucket (starting one bucket further each
        time, so a busy bucket cannot starve the others)."""
        claimed: list[Delivery] = []
        for i in range(BUCKETS):
            room = budget - len(claimed)
            if room <= 0:
                break
            b = (self._first_bucket + i) % BUCKETS
            claimed += await self.deliveries.claim(b, self.lease_ms, min(room, CLAIM_BATCH))
        self._first_bucket = (self._first_bucket + 1) % BUCKETS
        return [d for d in claimed if d.status == "pending"]

    async def _send(self, delivery: Delivery) -> None:
        if self.session is None:
            self.session = new_session(self.policy)
        async with self.limit:
            if delivery.webhook.startswith("ch:"):
                attempt, final = await self._ping(delivery, self.session)
            else:
                attempt, final = await self._webhook(delivery, self.session)
        delays = [] if final else [round(s * random.uniform(0.8, 1.2) * 1000) for s in self.schedule]
        reply = await self.deliveries.settle(delivery, attempt, delays)
        self.sent += 1
        outcome = "delivered" if attempt.ok else "retry"
        if reply.code is Code.APPLIED and reply.fields is not None:
            outcome = SETTLED_AS.get(str(reply.fields.get("status")), outcome)
        self.attempts["ping" if delivery.webhook.startswith("ch:") else "webhook", outcome] += 1
        if not attempt.ok:
            log.info(
                "delivery %s (%s) failed, attempt %d: %s",
                delivery.id,
                delivery.webhook,
                delivery.attempts + 1,
                attempt.error,
            )

    async def _webhook(self, delivery: Delivery, session: aiohttp.ClientSession) -> tuple[Attempt, bool]:
        """(what the attempt did, whether retrying is pointless)."""
        secret = await self._secret_of(delivery)
        if secret is None:
            return Attempt(0, "the endpoint was deleted", 0), True
        headers = signed_headers(delivery.id, secret, delivery.body, datetime.now(UTC))
        body = delivery.body.encode()
        return await post(session, self.policy, delivery.url, body, headers, self.timeout), False

    async def _secret_of(self, delivery: Delivery) -> str | None:
        """A registered endpoint's secret, or the one a question was created with for its own URL."""
        if delivery.webhook.startswith("q:"):
            key = self.pings.keys.for_question(delivery.question).question
            secret: Any = await self.pings.redis.hget(key, "hook_secret")
            return None if secret is None else str(secret)
        hook = await self.registry.find(delivery.webhook)
        return None if hook is None else hook.secret

    async def _ping(self, delivery: Delivery, session: aiohttp.ClientSession) -> tuple[Attempt, bool]:
        user, name = parse_ref(delivery.webhook)
        channel = await self.pings.channels.get(user, name)
        if channel is None:
            return Attempt(0, "the channel was deleted", 0), True
        question = await self.pings.questions.read(delivery.question)
        if question is None:
            return Attempt(0, "the question is gone (retention)", 0), True
        key = await self.pings.server_keys.action_key()
        fields = question.fields
        ping = await build_ping(fields, user, self.pings.public_url, key, envelope(fields))
        attempt = await send_ping(
            session,
            self.policy,
            channel,
            ping,
            delivery=delivery.id,
            server_keys=self.pings.server_keys,
            vapid_subject=self.pings.vapid_subject,
            timeout=self.timeout,
        )
        return attempt, False


def claim_budget(lease_seconds: float, timeout: float) -> int:
    """How many deliveries one pass may claim so that every one is sent and recorded before its
    lease runs out (else another sender sends it too): as many rounds of SEND_CONCURRENCY
    attempts, each up to `timeout`, as fit in the lease with one round to spare."""
    rounds = max(1, int(lease_seconds // timeout) - 1)
    return SEND_CONCURRENCY * rounds


class DeliveryWorkers:
    """The fan-out and the sender of one process, built from the settings, started and stopped together."""

    def __init__(self, redis: Redis, scripts: Scripts, settings: Settings, *, blocking: Redis | None = None):
        keys = Keys(settings.key_prefix)
        policy = OutboundPolicy(parse_nets(settings.outbound_allow_nets))
        self.registry = WebhookRegistry(redis, scripts, keys, policy)
        self.channels = ChannelRegistry(redis, scripts, keys, policy)
        self.server_keys = ServerKeys(redis, keys)
        self.store = DeliveryStore(redis, scripts, keys, settings.retention_seconds * 1000)
        pings = PingContext(
            redis,
            keys,
            self.channels,
            self.server_keys,
            settings.base_url,
            settings.vapid_subject,
            settings.retention_seconds,
            QuestionStore(redis, scripts, settings),
        )
        self.fanout = OutboxFanout(self.store, self.registry, pings, blocking=blocking)
        self.sender = DeliverySender(
            self.store,
            self.registry,
            policy,
            pings,
            schedule=parse_schedule(settings.webhook_retry_schedule),
            timeout=settings.webhook_timeout_seconds,
            lease_seconds=settings.delivery_lease_seconds,
        )
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        try:
            await self.fanout.ensure_groups()
        except RedisError as exc:
            log.warning("cannot create the delivery fan-out's groups yet (%s); it will retry", exc)
        self.tasks = [
            asyncio.create_task(self.fanout.run(), name="delivery-fanout"),
            asyncio.create_task(self.sender.run(), name="delivery-sender"),
        ]

    async def stop(self) -> None:
        self.fanout.stopping = self.sender.stopping = True
        await stop_tasks(self.tasks)
        await self.sender.aclose()
