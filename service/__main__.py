"""Command line: `serve`, `sweep`, and `admin ...` (which talks to Redis directly, for bootstrap)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from service import cli_client
from service.settings import Settings, SettingsError, env_name

if TYPE_CHECKING:
    from aiohttp import web

    from service.auth import Directory

log = logging.getLogger("service")


def settings_flags() -> argparse.ArgumentParser:
    """One flag per setting (`--redis-url` for QS_REDIS_URL ...); a flag beats the environment."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("settings (each also read from its QS_ variable)")
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(flag, dest=f.name, default=None, help=f"{env_name(f.name)}")
    return parent


def build_parser() -> argparse.ArgumentParser:
    flags = settings_flags()
    parser = argparse.ArgumentParser(prog="question-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", parents=[flags], help="run the HTTP service (with sweeper)")
    sweep = sub.add_parser("sweep", parents=[flags], help="run only the deadline sweeper")
    sweep.add_argument("--once", action="store_true", help="one pass, print totals, exit")
    sub.add_parser(
        "worker", parents=[flags], help="run the background jobs without HTTP (any number at once)"
    )
    stats = sub.add_parser("stats", parents=[flags], help="print the Redis-side figures and checks")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    admin = sub.add_parser("admin", help="manage principals, tokens and rooms in Redis")
    actions = admin.add_subparsers(dest="action", required=True)
    p = actions.add_parser("create-principal", parents=[flags], help="create a principal + token")
    p.add_argument("id")
    p.add_argument("--kind", choices=["agent", "user", "admin"], required=True)
    p.add_argument("--display-name", default="")
    p = actions.add_parser("issue-token", parents=[flags], help="issue another token")
    p.add_argument("id")
    p.add_argument("--expires-in", type=int, default=None, help="seconds")
    p = actions.add_parser("revoke-token", parents=[flags], help="revoke by id or qs_<id> prefix")
    p.add_argument("ref")
    p = actions.add_parser("set-room", parents=[flags], help="create a room / replace members")
    p.add_argument("room")
    p.add_argument("members", nargs="*")
    p = actions.add_parser("add-member", parents=[flags], help="add a user to a room")
    p.add_argument("room")
    p.add_argument("user")
    p = actions.add_parser("remove-member", parents=[flags], help="remove a user from a room")
    p.add_argument("room")
    p.add_argument("user")
    p = actions.add_parser("show-room", parents=[flags], help="print a room's members")
    p.add_argument("room")
    p = actions.add_parser(
        "sign-in-link", parents=[flags], help="issue a user a token and print the web inbox link"
    )
    p.add_argument("id")
    p.add_argument("--base-url", default=None, help="the service as users reach it (QS_PUBLIC_URL)")
    p.add_argument("--expires-in", type=int, default=SIGN_IN_LINK_SECONDS, help="seconds (30 days)")
    cli_client.add_commands(sub)  # ask, wait, get, list, answer, cancel, mcp: HTTP clients
    return parser


SIGN_IN_LINK_SECONDS = 30 * 86400


def load_settings(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f.name, None) for f in fields(Settings)}
    env = {env_name(k): v for k, v in overrides.items() if v is not None}
    return Settings.from_env({**_environ(), **env})


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def serve(settings: Settings) -> None:
    from aiohttp import web

    web.run_app(
        serving_app(settings),
        host=settings.host,
        port=settings.port,
        loop=new_event_loop(),
        reuse_port=settings.reuse_port,
        print=lambda _: log.info("serving on http://%s:%d", settings.host, settings.port),
        **server_options(settings),
    )


def server_options(settings: Settings) -> dict[str, Any]:
    """aiohttp's server options as `serve` sets them (tests serve the app with the same)."""
    return {
        # A client that gives up on a long poll must release its waiter at once, not at timeout.
        "handler_cancellation": True,
        # aiohttp applies it to a request's headers too: a trickling client is cut off there.
        "keepalive_timeout": settings.keepalive_seconds,
        "access_log": None,  # QS_ACCESS_LOG lines come from service.logs' middleware (structured)
    }


def serving_app(settings: Settings) -> web.Application:
    """The app as `serve` runs it: create_app's, plus freezing what its startup made."""
    from service.http.app import create_app

    app = create_app(settings)
    app.on_startup.append(freeze_startup_objects)
    return app


YOUNG_GENERATION_THRESHOLD = 10_000


async def freeze_startup_objects(app: web.Application) -> None:
    """Move everything alive once the app has started (modules, scripts, pools, routes) out of the
    garbage collector's sight. Each full collection walked all of it: ~50 ms per pause with ~90,000
    tracked objects, the p99 of every route (docs/benchmarks.md). Runs after the cleanup contexts
    (on_startup keeps the order of registration). In `serve` and the bench's servers, never in
    the tests' many short-lived apps: whatever is frozen and later dropped in a cycle stays.

    The young generation is then collected after 10,000 net new objects instead of 700: each
    request leaves cycles (request, task, futures) for the collector, and every collection also
    walks whatever the requests in flight hold, so fewer, larger collections cost less. Measured
    with bench.ab (medians, this commit against the one before): fetch 91.7 -> 86.8 µs, create
    173.4 -> 164.5 µs of CPU per request. The bench's baseline runs this function too."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, *gc.get_threshold()[1:])


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (Linux, macOS): it serves the same load with less CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def background(settings: Settings, *, once: bool = False, sweeper_only: bool = False) -> None:
    """The sweeper, and unless `sweeper_only`, the keyspace listener, the event relay and the
    webhook fan-out and sender; /metrics on QS_METRICS_PORT when it is set."""
    from service.delivery import DeliveryWorkers
    from service.events import EventRelay
    from service.keys import Keys
    from service.metrics import Metrics
    from service.redis_client import connect, connect_blocking
    from service.scripts import Scripts
    from service.store import QuestionStore
    from service.sweeper import KeyspaceListener, Sweeper

    redis = connect(settings)
    scripts = Scripts(redis, shebang=not settings.in_memory)
    keys = Keys(settings.key_prefix)
    metrics = scripts.metrics = Metrics()
    workers: DeliveryWorkers | None = None
    try:
        store = QuestionStore(redis, scripts, settings)
        sweeper = metrics.sweeper = Sweeper(store, settings.sweep_interval_seconds)
        if once:
            totals = await sweeper.sweep_once()
            print(json.dumps({"expired": totals.expired, "purged": totals.purged}))
            return
        jobs = [sweeper.run()]
        if not sweeper_only and settings.keyspace_notifications and not settings.in_memory:
            listener = metrics.listener = KeyspaceListener(redis, store, keys)
            jobs.append(listener.run())
        if not sweeper_only:
            blocking = connect_blocking(settings, redis)
            relay = metrics.relay = EventRelay(
                redis,
                keys,
                maxlen=settings.events_maxlen,
                ttl_seconds=settings.retention_seconds,
                blocking=blocking,
            )
            workers = DeliveryWorkers(redis, scripts, settings, blocking=connect_blocking(settings, redis))
            metrics.sender = workers.sender
            metrics.outbox_consumers = [relay, workers.fanout]
            jobs += [relay.run(), workers.fanout.run(), workers.sender.run()]
        await run_with_metrics(jobs, metrics, redis, settings)
    finally:
        if workers is not None:
            await workers.sender.aclose()
        await scripts.aclose()
        await redis.aclose()


async def run_with_metrics(
    jobs: list[Coroutine[Any, Any, None]], metrics: Any, redis: Any, settings: Settings
) -> None:
    """Run the jobs; serve their /metrics on QS_METRICS_PORT meanwhile, when it is set."""
    from service.keys import Keys
    from service.metrics import start_metrics_site

    runner = None
    if settings.metrics_port:
        keys = Keys(settings.key_prefix)

        async def render(accept: str) -> tuple[bytes, str]:
            await metrics.refresh_from_redis(redis, keys, settings.redis_timeout_seconds)
            result: tuple[bytes, str] = metrics.render(accept)
            return result

        runner = await start_metrics_site(render, settings.host, settings.metrics_port)
    try:
        await asyncio.gather(*jobs)
    finally:
        if runner is not None:
            await runner.cleanup()


async def admin(settings: Settings, args: argparse.Namespace) -> Any:
    from service.auth import Directory
    from service.errors import NotFound
    from service.keys import Keys
    from service.model import Kind, Principal
    from service.redis_client import connect

    redis = connect(settings)
    directory = Directory(redis, Keys(settings.key_prefix))
    try:
        if args.action == "create-principal":
            principal = Principal(args.id, Kind(args.kind), args.display_name)
            issued = await directory.create_principal(principal)
            return {"principal": principal.public(), "token": issued.token, "token_id": issued.token_id}
        if args.action == "issue-token":
            issued = await directory.issue_token(args.id, args.expires_in)
            return {
                "principal": issued.principal.public(),
                "token": issued.token,
                "token_id": issued.token_id,
                "expires_in": issued.expires_in,
            }
        if args.action == "revoke-token":
            if not await directory.revoke_token(args.ref):
                raise NotFound(f"no token {args.ref!r}")
            return {"revoked": args.ref}
        if args.action == "sign-in-link":
            return await sign_in_link(directory, settings, args)
        if args.action == "set-room":
            return {
                "room": args.room,
                "members": await directory.set_members(args.room, args.members),
            }
        if args.action == "add-member":
            await directory.add_member(args.room, args.user)
        elif args.action == "remove-member" and not await directory.remove_member(args.room, args.user):
            raise NotFound(f"{args.user!r} is not a member of room {args.room!r}")
        return {"room": args.room, "members": await directory.members(args.room)}
    finally:
        await redis.aclose()


async def sign_in_link(directory: Directory, settings: Settings, args: argparse.Namespace) -> str:
    """`<base>/#token=<new token>`: the fragment never reaches a server; the page stores it."""
    from urllib.parse import quote

    from service.errors import Invalid
    from service.model import Kind

    principal = await directory.require_principal(args.id)
    if principal.kind is not Kind.USER:
        raise Invalid(f"{args.id!r} is an {principal.kind.value}; sign-in links are for users")
    issued = await directory.issue_token(args.id, args.expires_in)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = (args.base_url or settings.public_url or f"http://{host}:{settings.port}").rstrip("/")
    return f"{base}/#token={quote(issued.token, safe='')}"


def main(argv: Sequence[str] | None = None) -> int:
    from service.errors import ServiceError

    args = build_parser().parse_args(argv)
    if args.command in cli_client.COMMANDS:
        return cli_client.run(args)
    try:
        settings = load_settings(args)
        if args.command == "serve":
            settings.validate_for_serving()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from service.logs import configure_logging

    configure_logging(settings)
    if args.command == "serve":
        serve(settings)
        return 0
    job: Coroutine[Any, Any, Any]
    if args.command == "sweep":
        job = background(settings, once=args.once, sweeper_only=True)
    elif args.command == "worker":
        job = background(settings)
    elif args.command == "stats":
        from service.stats import run as stats

        job = stats(settings, as_json=args.json)
    else:
        job = admin(settings, args)
    try:
        result = asyncio.run(job)
    except ServiceError as exc:
        print(f"error: {exc.detail}", file=sys.stderr)
        return 1
    except (RedisError, OSError) as exc:  # Redis unreachable or refusing: a line, not a traceback
        print(f"error: Redis: {exc}", file=sys.stderr)  # not the URL: it may hold a password
        return 1
    except KeyboardInterrupt:
        return 130
    if isinstance(result, str):
        print(result)  # a sign-in link, printed bare so it can be opened or copied as is
    elif result is not None:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
