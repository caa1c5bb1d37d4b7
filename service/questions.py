"""The domain: who may do what to which question, and which store call does it. No Redis here."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import msgpack
import msgspec

from service.auth import Directory
from service.bodies import Ask
from service.cache import Cache
from service.errors import Forbidden, Invalid, NotFound, TooManyQuestions, TooManyWaits
from service.keys import QUESTION_ID
from service.model import (
    MAX_METADATA_BYTES,
    Kind,
    Principal,
    Question,
    State,
    Target,
    canonical_json,
    canonical_json_without_floats,
)
from service.scripts import Code, Reply
from service.store import BadCursor, NewQuestion, Page, QuestionStore, keyed_call_id, new_call_id
from service.waiters import Waiters
from service.webhooks import new_secret


@dataclass(frozen=True, slots=True)
class Outcome:
    """The reply to a transition request: whether this request changed the state, and the story."""

    applied: bool
    question: Question


class QuestionService:
    def __init__(
        self, store: QuestionStore, directory: Directory, waiters: Waiters, *, waits_per_principal: int
    ) -> None:
        self.store = store
        self.directory = directory
        self.waiters = waiters
        self.waits_per_principal = waits_per_principal
        self.parked: dict[str, int] = {}  # principal id -> its long polls parked in this process
        # Whom a question is aimed at never changes: knowing it saves a room answer one script
        # call (direct answers need none). Small on purpose: the soak measured ~0.45 KiB of RSS
        # per entry, so 10,000 recent questions cost ~5 MiB; older ones take the two-call path.
        self.targets: Cache[Target] = Cache(10_000)

    def _learn(self, question: Question) -> Question:
        self.targets.put(question.id, question.target)
        return question

    def _learn_for(self, reader: Principal, question: Question) -> Question:
        """Remember the target when the reader may answer next (a user); an asker's fetches and
        long polls would only fill the cache (and every parked waiter's memory) for nothing."""
        return self._learn(question) if reader.kind is Kind.USER else question

    # -- ask ------------------------------------------------------------------------------------

    async def ask(self, asker: Principal, body: Ask, idempotency_key: str | None) -> tuple[Question, bool]:
        """Create a question; (question, True) when created, (original, False) on a replay."""
        require_kind(asker, Kind.AGENT, "only agents ask questions")
        target = await self._target(body)
        options = canonical_json_without_floats([{"id": o.id, "label": o.label} for o in body.options])
        option_ids = unique_option_ids(body)
        metadata = metadata_json(body)
        new = NewQuestion(
            asker=asker.id,
            target=target,
            prompt=body.prompt,
            options_json=options.decode(),
            option_ids=option_ids,
            metadata_json=metadata,
            expires_in_ms=(body.expires_in or 0) * 1000,
            expires_at_ms=deadline_ms(body),
            digest=request_digest(body, metadata),
            webhook_url=body.webhook_url or "",
            webhook_secret=new_secret() if body.webhook_url else "",
        )
        reply = await self.store.create(new, idempotency_key)
        if reply.code is Code.CREATED:
            return self._learn(question_of(reply)), True
        if reply.code is Code.REPLAYED:
            original = await self.store.read(reply.value or "")
            if original is None:
                raise NotFound("the question this Idempotency-Key created no longer exists")
            return original, False
        if reply.code is Code.IDEMPOTENCY_CONFLICT:
            raise Invalid("this Idempotency-Key was used with a different request body")
        if reply.code is Code.FULL:
            raise TooManyQuestions(
                f"{asker.id!r} keeps as many questions as QS_QUESTIONS_PER_AGENT allows ({reply.value} "
                "in this id bucket, about 16 times that in all; ended ones count until the retention "
                "removes them). Retry later, or ask as another agent"
            )
        raise Invalid("expires_at must be in the future and at most 30 days away")

    async def _target(self, body: Ask) -> Target:
        to = body.to
        if (to.user is None) == (to.room is None):
            raise Invalid("'to' must name exactly one of 'user' or 'room'")
        if to.user is not None:
            user = await self.directory.principal(to.user)
            if user is None or user.kind is not Kind.USER:
                raise Invalid(f"no user {to.user!r}")
            return Target("user", to.user)
        assert to.room is not None
        if not await self.directory.room_exists(to.room):
            raise Invalid(f"no room {to.room!r}")
        return Target("room", to.room)

    # -- read -----------------------------------------------------------------------------------

    async def get(self, principal: Principal, question_id: str) -> Question:
        question = await self.store.read(question_id) if QUESTION_ID.match(question_id) else None
        if question is None or not await self.visible(principal, question):
            raise NotFound(f"no question {question_id!r}")
        return self._learn_for(principal, question)

    async def visible(self, principal: Principal, question: Question) -> bool:
        access = access_of(principal, question)
        if isinstance(access, str):
            return await self.directory.is_member(access, principal.id)
        return access

    async def wait(self, principal: Principal, question_id: str, timeout: float) -> Question:
        question = await self.get(principal, question_id)
        if question.state.terminal or timeout <= 0:
            return question
        del question  # a parked request should not hold the question's fields (KiBs per waiter)
        with self._parking(principal):
            woken = await self.waiters.wait(question_id, timeout)
        if woken is not None:
            # Asked again: the reader may have left the question's room while it waited.
            if not await self.visible(principal, woken):
                raise NotFound(f"no question {question_id!r}")
            return woken
        # Timed out (or the question vanished): the hash is the truth.
        return await self.get(principal, question_id)

    async def wait_many(
        self, principal: Principal, question_ids: Sequence[str], timeout: float, *, every: bool
    ) -> tuple[list[Question], bool]:
        """Every question's envelope once any (or every) one is terminal, or at the timeout;
        and whether that condition held."""
        unique = list(dict.fromkeys(question_ids))
        questions = await self._visible_many(principal, unique)
        if not settled(questions, every) and timeout > 0:
            with self._parking(principal):
                await self.waiters.wait_many(unique, timeout, every=every)
            questions = await self._visible_many(principal, unique)
        return questions, settled(questions, every)

    @contextmanager
    def _parking(self, principal: Principal) -> Iterator[None]:
        """Count a long poll against its principal while it is parked: one agent's runaway loop
        must not take every socket and megabytes of the process from the others. Only a wait
        that parks counts; one answered at once (terminal, or timeout 0) never does."""
        held = self.parked.get(principal.id, 0)
        if held >= self.waits_per_principal:
            raise TooManyWaits(
                f"{principal.id!r} has {held} long polls parked in this process; let one return "
                "or wait on many questions in one POST /v1/questions/wait"
            )
        self.parked[principal.id] = held + 1
        try:
            yield
        finally:
            if self.parked[principal.id] == 1:
                del self.parked[principal.id]
            else:
                self.parked[principal.id] -= 1

    async def _visible_many(self, principal: Principal, question_ids: Sequence[str]) -> list[Question]:
        valid = [q for q in question_ids if QUESTION_ID.match(q)]
        found = {q.id: q for q in await self.store.read_many(valid) if q is not None}
        missing = [q_id for q_id in question_ids if q_id not in found]
        access = {q_id: access_of(principal, question) for q_id, question in found.items()}
        member = await self._memberships(principal, {a for a in access.values() if isinstance(a, str)})
        granted = {q_id: member[a] if isinstance(a, str) else a for q_id, a in access.items()}
        missing += [q_id for q_id, seen in granted.items() if not seen]
        if missing:
            raise NotFound(f"no questions {sorted(missing)}")
        return [self._learn_for(principal, found[q_id]) for q_id in question_ids]

    async def _memberships(self, user: Principal, rooms: set[str]) -> dict[str, bool]:
        """Whether `user` is in each room: one read per room, all in flight at once, so that a
        batch of a room's questions costs one coalesced round trip, not one per question."""
        if not rooms:
            return {}  # agents and direct questions: no task, no round trip
        ordered = sorted(rooms)
        found = await asyncio.gather(*(self.directory.is_member(r, user.id) for r in ordered))
        return dict(zip(ordered, found, strict=True))

    async def list_page(
        self,
        principal: Principal,
        *,
        role: str | None,
        state: State | None,
        room: str | None,
        limit: int,
        cursor: str | None,
    ) -> Page:
        role = role or ("responder" if principal.kind is Kind.USER else "asker")
        if principal.kind is Kind.ADMIN:
            if room is None:
                raise Invalid("admins list one room at a time: add room=<id>")
            index = self.store.index_keys(None, [Target("room", room)])
        elif role == "asker":
            require_kind(principal, Kind.AGENT, "role=asker lists an agent's own questions")
            index = self.store.index_keys(principal.id, [])
        else:
            require_kind(principal, Kind.USER, "role=responder lists what a user may answer")
            index = self.store.index_keys(None, await self._responder_targets(principal, room))

        def keep(q: Question) -> bool:
            if state is not None and q.state is not state:
                return False
            return room is None or q.target == Target("room", room)

        try:
            return await self.store.page(index, cursor=cursor, limit=limit, keep=keep)
        except BadCursor as exc:
            raise Invalid("cursor is not one this service issued") from exc

    async def _responder_targets(self, user: Principal, room: str | None) -> list[Target]:
        if room is not None:
            if not await self.directory.is_member(room, user.id):
                raise Forbidden(f"{user.id!r} is not a member of room {room!r}")
            return [Target("room", room)]
        rooms = await self.directory.rooms_of(user.id)
        return [Target("user", user.id), *(Target("room", r) for r in rooms)]

    # -- transitions ----------------------------------------------------------------------------

    async def answer(
        self, principal: Principal, question_id: str, option: str, idempotency_key: str | None = None
    ) -> Outcome:
        """With `idempotency_key`, the same request sent again reports `applied` again when its
        first try made the transition (a retry after a lost reply), and changes nothing."""
        if not QUESTION_ID.match(question_id):
            raise NotFound(f"no question {question_id!r}")
        if principal.kind is not Kind.USER:
            await self.get(principal, question_id)  # 404 unless it may see the question
            raise Forbidden("only the target user or a member of the target room may answer")
        call_id = call_id_of(idempotency_key, principal.id, "answer", question_id, option)
        reply = await self._answer_as(principal, question_id, option, call_id)
        if reply.code is Code.NOT_ELIGIBLE:
            raise NotFound(f"no question {question_id!r}")  # for users, eligible == visible
        if reply.code is Code.UNKNOWN_OPTION:
            raise Invalid(f"{option!r} is not one of this question's options")
        return outcome_of(question_id, reply)

    async def answer_by_link(self, user: Principal, question_id: str, option: str, key: str) -> Outcome:
        """A Ping's signed link proves its user was asked. Once the question has ended, the tap
        shows how (applied: false), also to a user who has left its room meanwhile: a stale tap
        is not an error. While it is pending, the user must be eligible now."""
        try:
            return await self.answer(user, question_id, option, key)
        except NotFound:
            question = await self.store.read(question_id)
            if question is None or not question.state.terminal:
                raise
            return Outcome(False, question)

    async def as_the_link_left_it(self, question_id: str) -> Question:
        """The question of a used action link, as it is now. A link is marked used only by a tap
        that ended in the question's final state, and it proves its user was asked: whether the
        user is still in the room does not hide that state (the repeated tap is a 409 that shows
        it, not a 404)."""
        question = await self.store.read(question_id)
        if question is None:
            raise NotFound(f"no question {question_id!r}")
        return question

    async def _answer_as(self, user: Principal, question_id: str, option: str, call_id: str) -> Reply:
        """Answer with the room membership this question needs, read just before the script.
        A question whose target this process does not know yet goes without it first (the
        common case, a direct question: one Redis call); a room question replies with its room."""
        target = self.targets.get(question_id)
        rooms = await self._rooms_for(user, target) if target is not None else None
        reply = await self.store.answer(question_id, user.id, option, rooms, call_id)
        if reply.code is Code.ROOMS_NEEDED:
            rooms = await self._rooms_for(user, Target("room", reply.value or ""))
            reply = await self.store.answer(question_id, user.id, option, rooms, call_id)
        if reply.fields is not None:
            self._learn(Question(reply.fields))
        return reply

    async def _rooms_for(self, user: Principal, target: Target) -> list[str]:
        if target.kind == "room" and await self.directory.is_member(target.id, user.id):
            return [target.id]
        return []

    async def cancel(
        self, principal: Principal, question_id: str, reason: str, idempotency_key: str | None = None
    ) -> Outcome:
        """`idempotency_key`: as for answer."""
        if not QUESTION_ID.match(question_id):
            raise NotFound(f"no question {question_id!r}")
        admin = principal.kind is Kind.ADMIN
        call_id = call_id_of(idempotency_key, principal.id, "cancel", question_id, reason)
        reply = await self.store.cancel(question_id, principal.id, reason, any_asker=admin, call_id=call_id)
        if reply.code is Code.NOT_ASKER:
            if await self.visible(principal, question_of(reply)):
                raise Forbidden("only the question's asker or an admin may cancel it")
            raise NotFound(f"no question {question_id!r}")
        return outcome_of(question_id, reply)


def call_id_of(idempotency_key: str | None, *request: str) -> str:
    return new_call_id() if idempotency_key is None else keyed_call_id(idempotency_key, *request)


def access_of(principal: Principal, question: Question) -> bool | str:
    """Whether `principal` may see `question` when that follows from the question alone, or else
    the room whose membership decides it (a user and a room question not of their asking)."""
    if principal.kind is Kind.ADMIN or principal.id == question.asker:
        return True
    if principal.kind is not Kind.USER:
        return False
    target = question.target
    if target.kind == "user":
        return target.id == principal.id
    return target.id


def settled(questions: Sequence[Question], every: bool) -> bool:
    terminal = [q.state.terminal for q in questions]
    return all(terminal) if every else any(terminal)


def outcome_of(question_id: str, reply: Reply) -> Outcome:
    if reply.code is Code.NOT_FOUND:
        raise NotFound(f"no question {question_id!r}")
    return Outcome(reply.code is Code.APPLIED, question_of(reply))


def question_of(reply: Reply) -> Question:
    if reply.fields is None:
        raise RuntimeError(f"script reply {reply.code} carries no question")
    return Question(reply.fields)


def require_kind(principal: Principal, kind: Kind, why: str) -> None:
    if principal.kind is not kind:
        raise Forbidden(why)


def unique_option_ids(body: Ask) -> list[str]:
    ids = [o.id for o in body.options]
    if len(set(ids)) != len(ids):
        raise Invalid("option ids must be unique")
    return ids


def metadata_json(body: Ask) -> str:
    if not body.metadata:
        return "{}"
    try:
        encoded = canonical_json(body.metadata)
    except (TypeError, ValueError, RecursionError) as exc:
        raise Invalid("metadata must be JSON-compatible (no binary, no non-finite numbers)") from exc
    if len(encoded.encode()) > MAX_METADATA_BYTES:
        raise Invalid(f"metadata encodes to more than {MAX_METADATA_BYTES} bytes")
    try:  # every envelope must encode as msgpack too, or its msgpack replies would fail later
        msgpack.packb(body.metadata)
    except OverflowError as exc:
        raise Invalid("metadata integers must fit in 64 bits (from -2**63 to 2**64 - 1)") from exc
    return encoded


# RFC 3339 section 5.6; the offset is optional here only so that its absence gets its own message.
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:[Zz]|[+-]\d{2}:\d{2})?\Z")


def deadline_ms(body: Ask) -> int:
    """The absolute deadline in ms, or 0 when `expires_in` is used. Its distance from Redis TIME
    is checked inside the create script: the service host's clock decides nothing."""
    if (body.expires_in is None) == (body.expires_at is None):
        raise Invalid("give exactly one of expires_in (seconds) or expires_at (RFC 3339)")
    if body.expires_at is None:
        return 0
    try:
        if not _RFC3339.match(body.expires_at):
            # fromisoformat alone also takes ISO 8601 forms RFC 3339 does not (no seconds, basic).
            raise ValueError(body.expires_at)
        # RFC 3339 allows a lowercase 't' and 'z'; fromisoformat (3.11) takes only capitals.
        moment = datetime.fromisoformat(body.expires_at.upper())
    except ValueError as exc:
        raise Invalid("expires_at must be an RFC 3339 timestamp, like 2030-01-31T09:30:00Z") from exc
    if moment.tzinfo is None:
        raise Invalid("expires_at must carry a timezone offset (for example Z)")
    return int(moment.timestamp() * 1000)


def request_digest(body: Ask, metadata_json: str) -> str:
    """The same request sent as JSON or msgpack has the same digest. `metadata_json` is the body's
    metadata as canonical_json wrote it (floats included), placed as it is."""
    metadata = None if body.metadata is None else msgspec.Raw(metadata_json.encode())
    canonical = canonical_json_without_floats(
        {
            "prompt": body.prompt,
            "options": [[o.id, o.label] for o in body.options],
            "to": [body.to.user, body.to.room],
            "expires_in": body.expires_in,
            "expires_at": body.expires_at,
            "metadata": metadata,
            # Only when given, so digests of requests without one stay what they were.
            **({"webhook_url": body.webhook_url} if body.webhook_url is not None else {}),
        }
    )
    return hashlib.sha256(canonical).hexdigest()
