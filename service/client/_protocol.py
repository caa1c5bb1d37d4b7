"""The I/O-free half of both clients: which request each call sends, how a reply is read, and
when to retry. `AsyncClient` and `Client` differ only in how they send and how they sleep."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import httpx
import msgpack

from service.client.errors import InvalidArgument, ProblemError, TransportError, problem_error
from service.client.models import (
    Duration,
    Envelope,
    OptionLike,
    Outcome,
    Page,
    Target,
    WaitManyResult,
    options_wire,
    parse_duration,
    parse_target,
)

log = logging.getLogger("service.client")
Wire = Literal["msgpack", "json"]
JSON = "application/json"
MSGPACK = "application/msgpack"
DEFAULT_POLL_SECONDS = 30.0
# A long poll may legitimately hold the connection this much longer than the wait it asked for.
LONG_POLL_SLACK_SECONDS = 15.0


@dataclass(frozen=True, slots=True)
class Retry:
    """Bounded exponential backoff with jitter, for connection failures and 5xx replies.

    The n-th consecutive failure waits a random time between half and all of
    `min(cap, base * 2**(n-1))` (a `Retry-After` from the service raises that, up to `cap`);
    after `attempts` tries in a row fail, the error is raised. A success resets the count, so a
    long `wait()` survives any number of separate outages.
    """

    attempts: int = 8
    base: float = 0.25
    cap: float = 8.0

    def delay(self, failures: int, retry_after: float | None = None) -> float | None:
        """Seconds to sleep after `failures` failures in a row, or None: give up."""
        if failures >= self.attempts:
            return None
        ceiling = min(self.cap, self.base * 2 ** (failures - 1))
        delay = ceiling / 2 + random.uniform(0, ceiling / 2)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.cap))
        return float(delay)


NO_RETRY = Retry(attempts=1)


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request, described before it is sent."""

    method: str
    path: str
    params: Mapping[str, str] = field(default_factory=dict)
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    long_poll: float | None = None  # seconds the service may hold the reply


@dataclass(frozen=True, slots=True)
class Config:
    url: str
    token: str
    wire: Wire
    retry: Retry
    timeout: float
    poll_seconds: float

    @classmethod
    def build(
        cls,
        url: str | None,
        token: str | None,
        wire: Wire,
        retry: Retry | None,
        timeout: float,
        poll_seconds: float,
    ) -> Config:
        url = url or os.environ.get("QS_URL") or ""
        token = token or os.environ.get("QS_TOKEN") or ""
        if not url:
            raise InvalidArgument("no service URL: pass url= (--url) or set QS_URL")
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"service URL {url!r} must start with http:// or https://")
        if not token:
            raise InvalidArgument("no token: pass token= (--token) or set QS_TOKEN")
        if wire not in ("msgpack", "json"):
            raise InvalidArgument(f"wire must be 'msgpack' or 'json', not {wire!r}")
        return cls(url.rstrip("/"), token, wire, retry or Retry(), timeout, poll_seconds)

    def headers(self) -> dict[str, str]:
        accept = MSGPACK if self.wire == "msgpack" else JSON
        return {"Authorization": f"Bearer {self.token}", "Accept": accept}

    def http_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0))

    def request_args(self, call: Call) -> dict[str, Any]:
        """Keyword arguments of `httpx.(Async)Client.request` for this call."""
        headers = dict(call.headers)
        content = None
        if call.body is not None:
            content = encode(call.body, self.wire)
            headers["Content-Type"] = MSGPACK if self.wire == "msgpack" else JSON
        args: dict[str, Any] = {
            "method": call.method,
            "url": call.path,
            "params": dict(call.params) or None,
            "content": content,
            "headers": headers,
        }
        if call.long_poll is not None:
            read = call.long_poll + LONG_POLL_SLACK_SECONDS
            args["timeout"] = httpx.Timeout(max(self.timeout, read), connect=min(self.timeout, 10.0))
        return args


def encode(body: Any, wire: Wire) -> bytes:
    if wire == "msgpack":
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def decode(response: httpx.Response) -> Any:
    media = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if not response.content:
        return None
    if media in (MSGPACK, "application/x-msgpack", "application/vnd.msgpack"):
        return msgpack.unpackb(response.content, raw=False)
    if media == JSON or media.endswith("+json"):
        return json.loads(response.content)
    return response.text


# A 429 that retrying within seconds cannot cure: the agent's kept questions leave only as the
# retention removes them. Other 429s (parked waits, open streams) clear as others finish.
LASTING_LIMITS = frozenset({"too-many-questions"})


def retryable(response: httpx.Response) -> bool:
    if response.status_code == 429:
        return problem(response).slug not in LASTING_LIMITS
    return response.status_code >= 500 or response.status_code == 408


def retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None


def reply(response: httpx.Response) -> Any:
    """The decoded body of a success, or the problem document raised as a typed exception."""
    if response.status_code < 400:
        return decode(response)
    raise problem(response)


def problem(response: httpx.Response) -> ProblemError:
    """The typed exception for an error reply; a body that is no problem document (a proxy's
    HTML page) becomes an `about:blank` problem with the reason phrase."""
    try:
        body = decode(response)
    except ValueError:
        body = response.text
    if not (isinstance(body, dict) and "status" in body and "title" in body):
        detail = body if isinstance(body, str) and body else response.reason_phrase
        body = {"type": "about:blank", "title": response.reason_phrase, "detail": str(detail)[:500]}
    return problem_error(
        response.status_code,
        str(body.get("type", "about:blank")),
        str(body.get("title", "")),
        str(body.get("detail", "")),
        body,
    )


def backoff(retry: Retry, call: Call, failures: int, failure: httpx.Response | httpx.TransportError) -> float:
    """Seconds to wait before sending `call` again after `failures` failures in a row (logged);
    raises the failure instead once the retries are used up or it cannot get better by retrying."""
    if isinstance(failure, httpx.Response):
        delay = retry.delay(failures, retry_after(failure))
        if delay is None:
            raise problem(failure)
        what = f"got {failure.status_code}"
    else:
        delay = None if isinstance(failure, httpx.UnsupportedProtocol) else retry.delay(failures)
        if delay is None:
            raise TransportError(f"{call.method} {call.path}: {failure!r}") from failure
        what = f"failed ({failure!r})"
    log.info("%s %s %s; retry %d in %.2f s", call.method, call.path, what, failures, delay)
    return delay


# -- the calls ----------------------------------------------------------------------------------


def new_idempotency_key() -> str:
    return "sdk-" + uuid.uuid4().hex


# What the service takes as an Idempotency-Key (service/http/routes.py), quotes aside.
_IDEMPOTENCY_KEY = re.compile(r"^[\x21\x23-\x7e]{1,255}\Z")


def require_text_keys(value: Any) -> None:
    """Metadata maps need text keys: msgpack refuses others and JSON would turn 1 into "1"."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            bad = [key for key in item if not isinstance(key, str)]
            if bad:
                raise InvalidArgument(f"metadata keys must be text, not {bad[0]!r}")
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def ask_call(
    prompt: str,
    options: Sequence[OptionLike],
    to: Target | str,
    timeout: Duration | None,
    expires_at: datetime | None,
    metadata: Mapping[str, Any] | None,
    idempotency_key: str,
) -> Call:
    if (timeout is None) == (expires_at is None):
        raise InvalidArgument("give exactly one of timeout= (a duration) or expires_at= (a datetime)")
    if not _IDEMPOTENCY_KEY.match(idempotency_key):
        raise InvalidArgument(
            f"idempotency_key {idempotency_key!r}: 1-255 printable ASCII characters, no spaces or quotes"
        )
    body: dict[str, Any] = {
        "prompt": prompt,
        "options": options_wire(options),
        "to": parse_target(to).wire(),
    }
    if timeout is not None:
        seconds = parse_duration(timeout)
        if seconds < 1:
            raise InvalidArgument(f"timeout {timeout!r} is shorter than one second")
        body["expires_in"] = int(-(-seconds // 1))  # whole seconds, rounded up
    elif expires_at is not None:
        if expires_at.tzinfo is None:
            raise InvalidArgument("expires_at must be timezone-aware")
        body["expires_at"] = expires_at.isoformat()
    if metadata is not None:
        body["metadata"] = dict(metadata)
        require_text_keys(body["metadata"])
    return Call("POST", "/v1/questions", body=body, headers={"Idempotency-Key": idempotency_key})


def question_path(question_id: str, action: str = "") -> str:
    if not question_id or "/" in question_id:
        raise InvalidArgument(f"{question_id!r} is not a question id")
    return f"/v1/questions/{question_id}" + (f"/{action}" if action else "")


def get_call(question_id: str) -> Call:
    return Call("GET", question_path(question_id))


def wait_call(question_id: str, seconds: float) -> Call:
    params = {"timeout": f"{seconds:.3f}"}
    return Call("GET", question_path(question_id, "wait"), params=params, long_poll=seconds)


def wait_many_call(ids: Sequence[str], mode: str, seconds: float) -> Call:
    if mode not in ("any", "all"):
        raise InvalidArgument(f"mode must be 'any' or 'all', not {mode!r}")
    body = {"ids": list(ids), "mode": mode, "timeout": round(seconds, 3)}
    return Call("POST", "/v1/questions/wait", body=body, long_poll=seconds)


# Answer and cancel carry a key of their own too: a retry after a lost reply is then told
# `applied` when the first try made the transition, instead of looking like someone else's.
def answer_call(question_id: str, option: str) -> Call:
    key = {"Idempotency-Key": new_idempotency_key()}
    return Call("POST", question_path(question_id, "answer"), body={"option": option}, headers=key)


def cancel_call(question_id: str, reason: str | None) -> Call:
    body = None if reason is None else {"reason": reason}
    key = {"Idempotency-Key": new_idempotency_key()}
    return Call("POST", question_path(question_id, "cancel"), body=body, headers=key)


def list_call(
    state: str | None, role: str | None, room: str | None, page_size: int, cursor: str | None
) -> Call:
    query = {"state": state, "role": role, "room": room, "limit": str(page_size), "cursor": cursor}
    return Call("GET", "/v1/questions", params={k: v for k, v in query.items() if v is not None})


def outcome(body: Mapping[str, Any]) -> Outcome:
    return Outcome(bool(body["applied"]), Envelope.parse(body["question"]))


def page(body: Mapping[str, Any]) -> Page:
    return Page(tuple(Envelope.parse(item) for item in body["items"]), body.get("next_cursor"))


def wait_many_result(body: Mapping[str, Any]) -> WaitManyResult:
    items = tuple(Envelope.parse(item) for item in body["items"])
    return WaitManyResult(items, body["mode"], bool(body["condition_met"]))
