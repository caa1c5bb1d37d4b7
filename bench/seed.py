"""Principals through the admin API, and many pending questions made fast.

Questions are created through the service's own QuestionStore (the same create.lua, keys and
arguments as the HTTP path, with thousands of calls coalesced into one pipeline), or, when that
API is not there, through many concurrent POST /v1/questions.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import aiohttp

PROMPT = "Deploy build 4711 to production?"
OPTIONS = [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}]
CHUNK = 2000


async def principal(base_url: str, admin_token: str, principal_id: str, kind: str) -> str:
    """A new token for the principal, creating it when it does not exist yet."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(
            f"{base_url}/v1/admin/principals", json={"id": principal_id, "kind": kind}
        ) as reply:
            if reply.status == 201:
                return str((await reply.json())["token"])
            if reply.status != 409:
                raise RuntimeError(f"creating {principal_id}: {reply.status} {await reply.text()}")
        async with http.post(f"{base_url}/v1/admin/principals/{principal_id}/tokens", json={}) as reply:
            if reply.status != 201:
                raise RuntimeError(f"token for {principal_id}: {reply.status} {await reply.text()}")
            return str((await reply.json())["token"])


async def create_via_store(
    redis_url: str,
    *,
    prefix: str,
    asker: str,
    user: str,
    count: int,
    expires_in_ms: int,
    outbox_maxlen: int | None = None,
) -> list[str]:
    """`count` pending questions through service.store.QuestionStore.create (one pipeline per chunk)."""
    from service.keys import new_question_id  # noqa: F401 - fail early when the API moved
    from service.model import Target, canonical_json
    from service.redis_client import connect
    from service.scripts import Code, Scripts
    from service.settings import Settings
    from service.store import NewQuestion, QuestionStore

    changes: dict[str, Any] = {"redis_url": redis_url, "key_prefix": prefix}
    if outbox_maxlen is not None:
        changes["outbox_maxlen"] = outbox_maxlen
    settings = Settings(**changes)
    redis = connect(settings)
    scripts = Scripts(redis)
    store = QuestionStore(redis, scripts, settings)
    new = NewQuestion(
        asker=asker,
        target=Target("user", user),
        prompt=PROMPT,
        options_json=canonical_json(OPTIONS),
        option_ids=[o["id"] for o in OPTIONS],
        metadata_json="{}",
        expires_in_ms=expires_in_ms,
        expires_at_ms=0,
        digest="",
    )
    ids: list[str] = []
    try:
        await scripts.load_all()
        for start in range(0, count, CHUNK):
            n = min(CHUNK, count - start)
            replies = await asyncio.gather(*(store.create(new, None) for _ in range(n)))
            for reply in replies:
                if reply.code is not Code.CREATED or reply.fields is None:
                    raise RuntimeError(f"create.lua replied {reply.code}")
                ids.append(reply.fields["id"])
    finally:
        aclose = getattr(scripts, "aclose", None)
        if aclose is not None:
            await aclose()
        await redis.aclose()
    return ids


def _create_in_process(kwargs: dict[str, Any]) -> list[str]:
    return asyncio.run(create_via_store(**kwargs))


def create_parallel(redis_url: str, count: int, processes: int | None = None, **kwargs: Any) -> list[str]:
    """create_via_store split over a few processes: the client side (redis-py parsing each reply
    in Python) is the slow part, so this uses the machine's cores."""
    processes = processes or min(4, os.cpu_count() or 1)
    if processes <= 1 or count < 4 * CHUNK:
        return asyncio.run(create_via_store(redis_url, count=count, **kwargs))
    shares = [count // processes + (1 if i < count % processes else 0) for i in range(processes)]
    jobs = [{"redis_url": redis_url, "count": n, **kwargs} for n in shares]
    with ProcessPoolExecutor(processes) as pool:
        return [q for ids in pool.map(_create_in_process, jobs) for q in ids]


async def create_via_http(
    base_url: str, agent_token: str, user: str, count: int, expires_in: int, concurrency: int = 64
) -> list[str]:
    """`count` questions through POST /v1/questions, `concurrency` at a time."""
    body = {"prompt": PROMPT, "options": OPTIONS, "to": {"user": user}, "expires_in": expires_in}
    ids: list[str] = []
    todo = iter(range(count))
    headers = {"Authorization": f"Bearer {agent_token}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as http:

        async def worker() -> None:
            for _ in todo:
                async with http.post(f"{base_url}/v1/questions", json=body) as reply:
                    if reply.status != 201:
                        raise RuntimeError(f"create: {reply.status} {await reply.text()}")
                    ids.append(str((await reply.json())["id"]))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ids


def create_questions(
    *,
    redis_url: str,
    base_url: str,
    agent_token: str,
    asker: str,
    user: str,
    count: int,
    expires_in_s: int = 3600,
    prefix: str = "qs",
    how: str = "store",
) -> tuple[list[str], str, float]:
    """(ids, how they were made, seconds taken). Call it outside any running event loop."""
    started = time.perf_counter()
    if how == "store":
        try:
            ids = create_parallel(
                redis_url, count, prefix=prefix, asker=asker, user=user, expires_in_ms=expires_in_s * 1000
            )
            return ids, "store", time.perf_counter() - started
        except (ImportError, TypeError, AttributeError) as exc:
            how = f"http (store API unavailable: {exc})"
    ids = asyncio.run(create_via_http(base_url, agent_token, user, count, expires_in_s))
    return ids, how, time.perf_counter() - started


def write_ids(path: Any, ids: Sequence[str]) -> None:
    with open(path, "w") as f:
        f.write("\n".join(ids) + "\n")
