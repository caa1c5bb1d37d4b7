"""The cost ladder between the bare baseline and the service's fetch: the same aiohttp server
(`web.run_app`, one process, uvloop, frozen after startup, no middleware, no auth, no metrics,
no logs) with one rung per route, each adding one layer of the real fetch path, so the bench can
say where a fetch's time goes instead of guessing.

    GET /script/{id}   + the service's QuestionStore.read (one coalesced EVALSHA of expire.lua
                       and its reply's interpretation), answering the baseline's small body
    GET /read/{id}     + QuestionStore.read and the envelope, answered as the service answers

The third rung is the service itself (`fetch`): its middlewares (request id, metrics, problem
documents, bearer authentication, query check), the reader's permission and the access line.

    python -m bench.ladder --port 8098 --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from bench.baseline import new_event_loop
from service.__main__ import freeze_startup_objects
from service.errors import NotFound
from service.http.codec import respond
from service.model import Question
from service.redis_client import connect
from service.scripts import Scripts
from service.settings import Settings
from service.store import QuestionStore

STORE = web.AppKey("store", QuestionStore)
SMALL = {"id": "ladder", "state": "pending", "version": 1}


async def ready(request: web.Request) -> web.Response:
    """Answers once the store is connected and its scripts loaded (the bench waits for it)."""
    return respond(request, SMALL)


async def script_only(request: web.Request) -> web.Response:
    """The Redis rung: the read script's round trip, none of the envelope or HTTP layers."""
    await read(request)
    return respond(request, SMALL)


async def read_envelope(request: web.Request) -> web.Response:
    """The domain rung: the store's read and the envelope, as `GET /v1/questions/{id}` answers
    (a Question encodes as its envelope, rendered once per version)."""
    return respond(request, await read(request))


async def read(request: web.Request) -> Question:
    question = await request.app[STORE].read(request.match_info["id"])
    if question is None:
        raise NotFound("no such question")  # the bench reads only questions it made: a 500 shows
    return question


def create_app(settings: Settings) -> web.Application:
    app = web.Application()

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        redis = connect(settings)
        scripts = Scripts(redis)
        await scripts.load_all()
        app[STORE] = QuestionStore(redis, scripts, settings)
        yield
        await scripts.aclose()
        await redis.aclose()

    app.cleanup_ctx.append(store_ctx)
    app.on_startup.append(freeze_startup_objects)  # as `serve` does
    app.add_routes(
        [web.get("/", ready), web.get("/script/{id}", script_only), web.get("/read/{id}", read_envelope)]
    )
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--redis", required=True, help="the Redis the service under test uses")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = Settings.from_env({"QS_REDIS_URL": args.redis})
    web.run_app(
        create_app(settings),
        host=args.host,
        port=args.port,
        loop=new_event_loop(),
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
