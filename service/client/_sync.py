"""Client: the SDK on httpx.Client, for code without an event loop. It mirrors _async.py line for
line (a test checks that both expose the same methods with the same signatures)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Literal

import httpx

from service.client import _protocol as p
from service.client.errors import WaitTimeout
from service.client.models import (
    Duration,
    Envelope,
    OptionLike,
    Outcome,
    Page,
    Result,
    Target,
    WaitManyResult,
    parse_duration,
)


class Question:
    """A question this client asked: its envelope at creation, and the ways to follow it."""

    def __init__(self, client: Client, envelope: Envelope, created: bool) -> None:
        self.client = client
        self.envelope = envelope
        self.created = created  # False: an earlier request with the same idempotency key made it

    @property
    def id(self) -> str:
        return self.envelope.id

    def wait(self, timeout: Duration | None = None) -> Result:
        return self.client.wait(self.id, timeout=timeout)

    def refresh(self) -> Envelope:
        self.envelope = self.client.get(self.id)
        return self.envelope

    def cancel(self, reason: str | None = None) -> Outcome:
        return self.client.cancel(self.id, reason=reason)

    def __repr__(self) -> str:
        return f"<Question {self.id} {self.envelope.state}>"


class Client:
    """The Question Service over HTTP, blocking.

    `url` and `token` default to the QS_URL and QS_TOKEN environment variables. Replies come as
    msgpack unless `wire="json"`. Every call retries connection failures and 5xx replies with
    `retry` (see `Retry`); `ask` sends one idempotency key on every try, so a retry never
    creates a second question; `answer` and `cancel` do too, so a retry whose first try
    applied still reports `applied`. Use it as `with Client() as client:` or call `close()`.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        wire: p.Wire = "msgpack",
        retry: p.Retry | None = None,
        timeout: float = 30.0,
        poll_seconds: float = p.DEFAULT_POLL_SECONDS,
        http: httpx.Client | None = None,
    ) -> None:
        self.config = p.Config.build(url, token, wire, retry, timeout, poll_seconds)
        self._owns_http = http is None  # a client passed in stays open for its owner
        self._http = http or httpx.Client(timeout=self.config.http_timeout())
        self._http.base_url = httpx.URL(self.config.url)
        self._http.headers.update(self.config.headers())

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def ask(
        self,
        prompt: str,
        options: Sequence[OptionLike],
        *,
        to: Target | str,
        timeout: Duration | None = None,
        expires_at: datetime | None = None,
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Question:
        """Ask `to` (User, Room, or "user:ID"/"room:ID") to pick one of `options` before
        `timeout` ("10m", seconds, timedelta) or `expires_at` passes."""
        key = idempotency_key or p.new_idempotency_key()
        call = p.ask_call(prompt, options, to, timeout, expires_at, metadata, key)
        status, body = self._send(call)
        return Question(self, Envelope.parse(body), created=status == 201)

    def get(self, question_id: str) -> Envelope:
        _, body = self._send(p.get_call(question_id))
        return Envelope.parse(body)

    def wait(self, question_id: str, *, timeout: Duration | None = None) -> Result:
        """Long-poll until the question is answered, expired or cancelled, and return how.
        With `timeout`, raise WaitTimeout if it is still pending after that long."""
        deadline = None if timeout is None else time.monotonic() + parse_duration(timeout)
        while True:
            seconds = self.config.poll_seconds
            if deadline is not None:
                seconds = max(0.0, min(seconds, deadline - time.monotonic()))
            _, body = self._send(p.wait_call(question_id, seconds))
            envelope = Envelope.parse(body)
            if envelope.terminal:
                return envelope.result()
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(envelope)

    def wait_many(
        self,
        ids: Sequence[str],
        *,
        mode: Literal["any", "all"] = "any",
        timeout: Duration | None = None,
    ) -> WaitManyResult:
        """Long-poll until any (or all) of `ids` has ended; after `timeout`, return what is
        there with `condition_met=False`. `timeout=0` looks once without waiting."""
        deadline = None if timeout is None else time.monotonic() + parse_duration(timeout)
        while True:
            seconds = self.config.poll_seconds
            if deadline is not None:
                seconds = max(0.0, min(seconds, deadline - time.monotonic()))
            _, body = self._send(p.wait_many_call(ids, mode, seconds))
            result = p.wait_many_result(body)
            if result.condition_met or (deadline is not None and time.monotonic() >= deadline):
                return result

    def answer(self, question_id: str, option: str) -> Outcome:
        _, body = self._send(p.answer_call(question_id, option))
        return p.outcome(body)

    def cancel(self, question_id: str, reason: str | None = None) -> Outcome:
        _, body = self._send(p.cancel_call(question_id, reason))
        return p.outcome(body)

    def list_page(
        self,
        *,
        state: str | None = None,
        role: str | None = None,
        room: str | None = None,
        page_size: int = 50,
        cursor: str | None = None,
    ) -> Page:
        _, body = self._send(p.list_call(state, role, room, page_size, cursor))
        return p.page(body)

    def list(
        self,
        *,
        state: str | None = None,
        role: str | None = None,
        room: str | None = None,
        page_size: int = 50,
        limit: int | None = None,
    ) -> Iterator[Envelope]:
        """Every matching question, newest first, following the cursor page by page; at most
        `limit` of them when given."""
        cursor: str | None = None
        seen = 0
        while True:
            page = self.list_page(state=state, role=role, room=room, page_size=page_size, cursor=cursor)
            for item in page.items:
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def _send(self, call: p.Call) -> tuple[int, Any]:
        """Send `call`, retrying connection failures and 5xx replies; (status, decoded body)."""
        failures = 0
        while True:
            failure: httpx.Response | httpx.TransportError
            try:
                response = self._http.request(**self.config.request_args(call))
            except httpx.TransportError as exc:
                failure = exc
            else:
                if not p.retryable(response):
                    return response.status_code, p.reply(response)
                failure = response
            failures += 1
            delay = p.backoff(self.config.retry, call, failures, failure)
            time.sleep(delay)
