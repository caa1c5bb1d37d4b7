"""A thin test driver for the HTTP API: principals, rooms, and one call per route."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgpack
from aiohttp.test_utils import TestClient


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


class Api:
    def __init__(self, client: TestClient[object, object], admin_token: str) -> None:
        self.client = client
        self.admin = admin_token

    async def call(
        self,
        method: str,
        path: str,
        token: str | None = None,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        content_type: str = "application/json",
        msgpack_reply: bool = False,
    ) -> Reply:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        data = raw
        if body is not None:
            if content_type == "application/msgpack":
                data = msgpack.packb(body, use_bin_type=True)
            else:
                data = json.dumps(body).encode()
        if data is not None:
            sent.setdefault("Content-Type", content_type)
        if msgpack_reply:
            sent["Accept"] = "application/msgpack"
        async with self.client.request(method, path, data=data, headers=sent) as response:
            payload = await response.read()
            kind = response.content_type
            if kind == "application/msgpack":
                decoded = msgpack.unpackb(payload, raw=False)
            elif payload and kind.endswith("json"):
                decoded = json.loads(payload)
            else:
                decoded = payload
            return Reply(response.status, decoded, dict(response.headers))

    async def principal(self, principal_id: str, kind: str) -> str:
        reply = await self.call(
            "POST", "/v1/admin/principals", self.admin, {"id": principal_id, "kind": kind}
        )
        assert reply.status == 201, reply.body
        token: str = reply.body["token"]
        return token

    async def room(self, room: str, members: list[str]) -> None:
        reply = await self.call("PUT", f"/v1/admin/rooms/{room}", self.admin, {"members": members})
        assert reply.status == 200, reply.body

    async def ask(
        self,
        token: str,
        to: dict[str, str],
        *,
        options: tuple[str, ...] = ("yes", "no"),
        expires_in: float = 60,
        headers: dict[str, str] | None = None,
        expect: int = 201,
        **extra: Any,
    ) -> dict[str, Any]:
        body = {
            "prompt": "Proceed?",
            "options": [{"id": o, "label": o.title()} for o in options],
            "to": to,
            "expires_in": expires_in,
            **extra,
        }
        reply = await self.call("POST", "/v1/questions", token, body, headers=headers)
        assert reply.status == expect, reply.body
        result: dict[str, Any] = reply.body
        return result

    async def get(self, token: str, question_id: str) -> Reply:
        return await self.call("GET", f"/v1/questions/{question_id}", token)

    async def answer(self, token: str, question_id: str, option: str) -> Reply:
        return await self.call("POST", f"/v1/questions/{question_id}/answer", token, {"option": option})

    async def cancel(self, token: str, question_id: str, reason: str | None = None) -> Reply:
        body = None if reason is None else {"reason": reason}
        return await self.call("POST", f"/v1/questions/{question_id}/cancel", token, body)

    async def wait(self, token: str, question_id: str, timeout: float) -> Reply:
        return await self.call("GET", f"/v1/questions/{question_id}/wait?timeout={timeout}", token)

    async def list(self, token: str, **query: Any) -> Reply:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        return await self.call("GET", f"/v1/questions?{qs}", token)
