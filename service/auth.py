"""Principals, bearer tokens (stored only as SHA-256 hashes) and rooms.

All directory keys share the ``{dir}`` hash tag, so a membership edit is one MULTI transaction
even on Redis Cluster.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Awaitable, Sequence, Sized
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from service.cache import Cache
from service.coalesce import Coalescer
from service.errors import Conflict, Invalid, NotFound
from service.keys import Keys
from service.model import IDENTIFIER, MAX_TOKEN_SECONDS, Kind, Principal

TOKEN_PREFIX = "qs_"
_TOKEN = re.compile(r"^qs_([0-9a-f]{12})_[A-Za-z0-9_-]{43}\Z")
_TOKEN_REF = re.compile(r"^(?:qs_)?([0-9a-f]{12})\Z")
BOOTSTRAP_ADMIN = Principal("admin", Kind.ADMIN, "bootstrap admin")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """(token, token id): 48 bits of public id and 256 bits of secret."""
    token_id = secrets.token_hex(6)
    return f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}", token_id


@dataclass(frozen=True, slots=True)
class IssuedToken:
    token: str
    token_id: str
    principal: Principal
    expires_in: int | None


class Directory:
    """`reads`: the coalescer that request-path reads (token, principal, room, memberships) go
    through, one batch per event-loop turn on one connection, instead of a pooled connection each.
    Writes and the admin's reads use the pool."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        admin_token: str = "",
        cache_seconds: float = 0,
        *,
        reads: Coalescer | None = None,
    ):
        self.redis = redis
        self.reads = reads
        self.keys = keys
        self.admin_token = admin_token
        # Token -> principal for a few seconds: a revocation reaches other processes that late.
        self.cache: Cache[Principal] = Cache(50_000, ttl=cache_seconds)
        # Raised by each revoke here: a lookup that read a token before a revoke's DEL must not
        # put it back into the cache after the revoke dropped it.
        self._revocations = 0
        # Principals and rooms are never deleted, so a positive answer stays true.
        self._principals: Cache[Principal] = Cache(50_000)
        self._rooms: Cache[bool] = Cache(10_000)

    def caches(self) -> dict[str, Sized]:
        """The in-process caches by name, for qs_cache_entries."""
        return {"tokens": self.cache, "principals": self._principals, "room_members": self._rooms}

    def _read(self, command: str, key: str, *args: str) -> Awaitable[Any]:
        if self.reads is not None:
            return self.reads.read(command, key, *args)
        return self.redis.execute_command(command, key, *args)  # type: ignore[no-untyped-call]

    # -- principals -----------------------------------------------------------------------------

    async def create_principal(self, principal: Principal) -> IssuedToken:
        """The principal and its first token, in one transaction: a failure leaves neither, so
        the create can be retried (a principal without a token answered its retry with a 409)."""
        check_identifier(principal.id, "principal id")
        if principal.id == BOOTSTRAP_ADMIN.id:
            # QS_ADMIN_TOKEN's principal: a second one of that name would share its event stream
            # and its name in `cancellation.by`.
            raise Conflict(f"principal {principal.id!r} is the bootstrap admin's (QS_ADMIN_TOKEN)")
        key = self.keys.principal(principal.id)
        token, token_id = new_token()

        async def create(pipe: Pipeline) -> None:
            # EXISTS by name: redis-py 8.1's cluster pipeline splits exists() by slot and queues
            # it instead of running it at once under WATCH (it always looked true).
            if await pipe.execute_command("EXISTS", key):
                raise Conflict(f"principal {principal.id!r} already exists")
            pipe.multi()  # type: ignore[no-untyped-call]
            pipe.hset(
                key,
                mapping={
                    "id": principal.id,
                    "kind": principal.kind.value,
                    "display_name": principal.display_name,
                    "created_at": str(int(time.time())),
                },
            )
            self._queue_token(pipe, principal.id, token, token_id, None)

        await self.redis.transaction(create, key)
        return IssuedToken(token, token_id, principal, None)

    async def principal(self, principal_id: str) -> Principal | None:
        if not IDENTIFIER.match(principal_id):
            return None
        known = self._principals.get(principal_id)
        if known is not None:
            return known
        found = await self._read("HMGET", self.keys.principal(principal_id), "kind", "display_name")
        if found[0] is None:
            return None
        principal = Principal(principal_id, Kind(str(found[0])), str(found[1] or ""))
        self._principals.put(principal_id, principal)
        return principal

    async def require_principal(self, principal_id: str) -> Principal:
        principal = await self.principal(principal_id)
        if principal is None:
            raise NotFound(f"no principal {principal_id!r}")
        return principal

    # -- tokens ---------------------------------------------------------------------------------

    async def issue_token(self, principal_id: str, expires_in: int | None = None) -> IssuedToken:
        if expires_in is not None and not 1 <= expires_in <= MAX_TOKEN_SECONDS:
            raise Invalid(f"expires_in must be 1 to {MAX_TOKEN_SECONDS} seconds, not {expires_in}")
        principal = await self.require_principal(principal_id)
        token, token_id = new_token()
        async with self.redis.pipeline(transaction=True) as pipe:
            self._queue_token(pipe, principal.id, token, token_id, expires_in)
            await pipe.execute()
        return IssuedToken(token, token_id, principal, expires_in)

    def _queue_token(
        self, pipe: Pipeline, principal_id: str, token: str, token_id: str, expires_in: int | None
    ) -> None:
        digest = hash_token(token)
        pipe.hset(self.keys.token(digest), mapping={"principal": principal_id, "id": token_id})
        pipe.set(self.keys.token_id(token_id), digest)
        if expires_in is not None:
            pipe.expire(self.keys.token(digest), expires_in)
            pipe.expire(self.keys.token_id(token_id), expires_in)

    async def revoke_token(self, reference: str) -> bool:
        """Revoke by token id, by its public prefix ``qs_<id>``, or by the whole token."""
        match = _TOKEN_REF.match(reference) or _TOKEN.match(reference)
        if not match:
            return False
        id_key = self.keys.token_id(match.group(1))
        found = await self.redis.get(id_key)
        whole = match.re is _TOKEN
        if found is None or (whole and not hmac.compare_digest(str(found), hash_token(reference))):
            return False  # a whole token is that token only, not any string with its prefix
        digest = str(found)
        # One DEL of both keys (one slot, {dir}): a failed revoke changes nothing, so its retry
        # finds the token again instead of a 404 while the token still works.
        await self.redis.delete(self.keys.token(digest), id_key)
        self._revocations += 1
        self.cache.drop(digest)
        return True

    async def authenticate(self, token: str) -> Principal | None:
        # surrogateescape: aiohttp hands undecodable header bytes over as lone surrogates.
        presented = token.encode(errors="surrogateescape")
        if self.admin_token and hmac.compare_digest(presented, self.admin_token.encode()):
            return BOOTSTRAP_ADMIN
        if not _TOKEN.match(token):
            return None
        digest = hash_token(token)
        cached = self.cache.get(digest)
        if cached is not None:
            return cached
        revocations = self._revocations
        principal_id = await self._read("HGET", self.keys.token(digest), "principal")
        principal = None if principal_id is None else await self.principal(str(principal_id))
        if principal is not None and revocations == self._revocations:
            self.cache.put(digest, principal)
        return principal

    # -- rooms ----------------------------------------------------------------------------------

    async def room_exists(self, room: str) -> bool:
        if not IDENTIFIER.match(room):
            return False
        if self._rooms.get(room):
            return True
        exists = bool(await self._read("EXISTS", self.keys.room(room)))
        if exists:
            self._rooms.put(room, True)
        return exists

    async def members(self, room: str) -> list[str]:
        if not await self.room_exists(room):
            raise NotFound(f"no room {room!r}")
        return sorted(str(m) for m in await self.redis.smembers(self.keys.room_members(room)))

    async def is_member(self, room: str, user: str) -> bool:
        return bool(await self._read("SISMEMBER", self.keys.room_members(room), user))

    async def rooms_of(self, user: str) -> list[str]:
        return sorted(str(r) for r in await self._read("SMEMBERS", self.keys.user_rooms(user)))

    async def set_members(self, room: str, members: Sequence[str]) -> list[str]:
        """Create the room if needed and make `members` its exact membership."""
        check_identifier(room, "room id")
        wanted = set(members)
        await self._require_users(wanted)
        members_key = self.keys.room_members(room)

        async def replace(pipe: Pipeline) -> None:
            current = {str(m) for m in await pipe.smembers(members_key)}
            pipe.multi()  # type: ignore[no-untyped-call]
            pipe.hsetnx(self.keys.room(room), "created_at", str(int(time.time())))
            for user in current - wanted:
                pipe.srem(self.keys.user_rooms(user), room)
            for user in wanted - current:
                pipe.sadd(self.keys.user_rooms(user), room)
            pipe.delete(members_key)
            if wanted:
                pipe.sadd(members_key, *wanted)

        await self.redis.transaction(replace, members_key)
        return sorted(wanted)

    async def add_member(self, room: str, user: str) -> None:
        if not await self.room_exists(room):
            raise NotFound(f"no room {room!r}")
        await self._require_users({user})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(self.keys.room_members(room), user)
            pipe.sadd(self.keys.user_rooms(user), room)
            await pipe.execute()

    async def remove_member(self, room: str, user: str) -> bool:
        if not await self.room_exists(room):
            raise NotFound(f"no room {room!r}")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(self.keys.room_members(room), user)
            pipe.srem(self.keys.user_rooms(user), room)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def _require_users(self, users: set[str]) -> None:
        for user in sorted(users):
            principal = await self.principal(user)
            if principal is None or principal.kind is not Kind.USER:
                raise Invalid(f"{user!r} is not a user principal")


def check_identifier(value: str, what: str) -> None:
    if not IDENTIFIER.match(value):
        raise Invalid(f"{what} must match {IDENTIFIER.pattern}")
