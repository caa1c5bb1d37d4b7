"""The key schema: every Redis key and channel name is built here and nowhere else.

Questions live in BUCKETS hash-tagged buckets (``{b0}`` .. ``{b15}``) so that everything one
script touches shares a Redis Cluster slot. A question id names its bucket in its first hex
digit. Directory data (principals, tokens, rooms) shares the ``{dir}`` tag. See docs/keys.md.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

BUCKETS = 16
QUESTION_ID = re.compile(r"^[0-9a-f]{25}\Z")


def new_question_id(bucket: int | None = None) -> str:
    """96 random bits behind one hex digit that names the bucket."""
    if bucket is None:
        bucket = secrets.randbelow(BUCKETS)
    return f"{bucket:x}{secrets.token_hex(12)}"


def bucket_of(question_id: str) -> int:
    return int(question_id[0], 16)


def idempotency_bucket(asker: str, key: str) -> int:
    return hashlib.sha256(f"{asker}\n{key}".encode()).digest()[0] % BUCKETS


def idempotency_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class QuestionKeys:
    """The keys of one question, all in its bucket's slot."""

    question: str
    deadline_marker: str
    deadlines: str
    purge: str
    channel: str
    outbox: str
    stats: str
    stale_calls: str


@dataclass(frozen=True)
class Keys:
    prefix: str

    def bucket(self, b: int) -> str:
        return f"{self.prefix}:{{b{b}}}"

    def for_question(self, question_id: str) -> QuestionKeys:
        b = self.bucket(bucket_of(question_id))
        return QuestionKeys(
            question=f"{b}:q:{question_id}",
            deadline_marker=f"{b}:ttl:{question_id}",
            deadlines=f"{b}:deadlines",
            purge=f"{b}:purge",
            channel=f"{b}:ch:{question_id}",
            outbox=f"{b}:outbox",
            stats=f"{b}:stats",
            stale_calls=f"{b}:stale:{question_id}",
        )

    def deadlines(self, b: int) -> str:
        return f"{self.bucket(b)}:deadlines"

    def purge(self, b: int) -> str:
        return f"{self.bucket(b)}:purge"

    def stats(self, b: int) -> str:
        return f"{self.bucket(b)}:stats"

    def outbox(self, b: int) -> str:
        return f"{self.bucket(b)}:outbox"

    def idempotency(self, b: int, asker: str, key: str) -> str:
        return f"{self.bucket(b)}:idem:{asker}:{idempotency_digest(key)}"

    def asker_index(self, b: int, asker: str) -> str:
        return f"{self.bucket(b)}:ix:asker:{asker}"

    def target_index(self, b: int, kind: str, target: str) -> str:
        """Index of questions aimed at one user (kind 'user') or one room (kind 'room')."""
        return f"{self.bucket(b)}:ix:{kind}:{target}"

    def question_id_from_marker(self, key: str) -> str | None:
        """The id behind an expired deadline-marker key of this prefix, or None."""
        head, sep, question_id = key.rpartition(":ttl:")
        if not sep or not QUESTION_ID.match(question_id):
            return None
        if head != self.bucket(bucket_of(question_id)):
            return None
        return question_id

    def events(self, principal_id: str) -> str:
        """A principal's event stream (SSE): its own slot, filled by the relay."""
        return f"{self.prefix}:{{p:{principal_id}}}:events"

    # Directory: principals, tokens and rooms share one slot, so membership edits are atomic.
    @property
    def directory(self) -> str:
        return f"{self.prefix}:{{dir}}"

    def principal(self, principal_id: str) -> str:
        return f"{self.directory}:principal:{principal_id}"

    def token(self, token_hash: str) -> str:
        return f"{self.directory}:token:{token_hash}"

    def token_id(self, token_id: str) -> str:
        return f"{self.directory}:tokenid:{token_id}"

    def room(self, room: str) -> str:
        return f"{self.directory}:room:{room}"

    def room_members(self, room: str) -> str:
        return f"{self.directory}:room:{room}:members"

    def user_rooms(self, user: str) -> str:
        return f"{self.directory}:user:{user}:rooms"

    # Outgoing webhooks: endpoints live with the directory; deliveries live in the bucket of the
    # question they carry, beside the outbox entry they came from.
    def webhook(self, webhook_id: str) -> str:
        return f"{self.directory}:webhook:{webhook_id}"

    def webhooks_of(self, owner: str) -> str:
        return f"{self.directory}:principal:{owner}:webhooks"

    def delivery(self, b: int, delivery_id: str) -> str:
        return f"{self.bucket(b)}:delivery:{delivery_id}"

    def deliveries_due(self, b: int) -> str:
        return f"{self.bucket(b)}:deliveries:due"

    def last_claim(self, b: int) -> str:
        return f"{self.bucket(b)}:deliveries:last-claim"

    def webhook_deliveries(self, b: int, webhook_id: str) -> str:
        return f"{self.bucket(b)}:webhook:{webhook_id}:deliveries"

    def dead_letters(self, b: int) -> str:
        return f"{self.bucket(b)}:deadletters"

    def pinged(self, question_id: str) -> str:
        """The channels that got a question's Ping, to withdraw it from when it ends."""
        return f"{self.bucket(bucket_of(question_id))}:pinged:{question_id}"

    def action_used(self, question_id: str, digest: str) -> str:
        """Marks one action link as used, so a replay is refused."""
        return f"{self.bucket(bucket_of(question_id))}:action:{digest}"
