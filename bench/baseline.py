"""The bare aiohttp baseline: one JSON handler returning a small object, served like the service
(`web.run_app`, one process, uvloop when the service would use it, frozen after startup as
`serve` freezes the service (service.__main__.freeze_startup_objects), no access log unless
QS_ACCESS_LOG is on). `/park` holds a request open, to price a parked request in bare aiohttp.

    python -m bench.baseline --port 8099
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os

from aiohttp import web

from service.__main__ import freeze_startup_objects

PARKED = web.AppKey("parked", list)


def _dumps(body: object) -> str:
    return json.dumps(body, separators=(",", ":"))


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"id": "baseline", "state": "pending", "version": 1}, dumps=_dumps)


async def park(request: web.Request) -> web.Response:
    """Hold the request until `timeout` seconds pass (like a long-poll nobody answers)."""
    timeout = float(request.query.get("timeout", "60"))
    counter = request.app[PARKED]
    counter[0] += 1
    try:
        await asyncio.sleep(timeout)
    finally:
        counter[0] -= 1
    return web.json_response({"parked": True}, dumps=_dumps)


async def parked(request: web.Request) -> web.Response:
    return web.json_response({"parked": request.app[PARKED][0]}, dumps=_dumps)


def create_app() -> web.Application:
    app = web.Application()
    app[PARKED] = [0]
    app.on_startup.append(freeze_startup_objects)  # as `serve` does
    app.add_routes([web.get("/", hello), web.get("/park", park), web.get("/parked", parked)])
    return app


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--asyncio", action="store_true", help="plain asyncio loop, not uvloop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    access = os.environ.get("QS_ACCESS_LOG", "").strip().lower() in ("1", "true", "yes", "on")
    web.run_app(
        create_app(),
        host=args.host,
        port=args.port,
        loop=asyncio.new_event_loop() if args.asyncio else new_event_loop(),
        access_log=logging.getLogger("aiohttp.access") if access else None,
        print=None,
    )


if __name__ == "__main__":
    main()
