"""Command line: `serve`, `sweep`, and `admin ...` (which talks to Redis directly, for bootstrap)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Coroutine, Sequence
from dataclasses import fields
from typing import Any

from service.settings import Settings, SettingsError, env_name

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
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f.name, None) for f in fields(Settings)}
    env = {env_name(k): v for k, v in overrides.items() if v is not None}
    return Settings.from_env({**_environ(), **env})


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def serve(settings: Settings) -> None:
    from aiohttp import web

    from service.http.app import create_app

    web.run_app(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop=new_event_loop(),
        reuse_port=settings.reuse_port,
        # A client that gives up on a long poll must release its waiter at once, not at timeout.
        handler_cancellation=True,
        access_log=logging.getLogger("aiohttp.access") if settings.access_log else None,
        print=lambda _: log.info("serving on http://%s:%d", settings.host, settings.port),
    )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (Linux, macOS): it serves the same load with less CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def background(settings: Settings, *, once: bool = False, sweeper_only: bool = False) -> None:
    """The sweeper, and unless `sweeper_only`, the keyspace listener and the event relay."""
    from service.events import EventRelay
    from service.keys import Keys
    from service.redis_client import connect, connect_blocking
    from service.scripts import Scripts
    from service.store import QuestionStore
    from service.sweeper import KeyspaceListener, Sweeper

    redis = connect(settings)
    scripts = Scripts(redis, shebang=not settings.in_memory)
    keys = Keys(settings.key_prefix)
    try:
        store = QuestionStore(redis, scripts, settings)
        sweeper = Sweeper(store, settings.sweep_interval_seconds)
        if once:
            totals = await sweeper.sweep_once()
            print(json.dumps({"expired": totals.expired, "purged": totals.purged}))
            return
        jobs = [sweeper.run()]
        if not sweeper_only and settings.keyspace_notifications and not settings.in_memory:
            jobs.append(KeyspaceListener(redis, store, keys).run())
        if not sweeper_only:
            relay = EventRelay(
                redis,
                keys,
                maxlen=settings.events_maxlen,
                ttl_seconds=settings.retention_seconds,
                blocking=connect_blocking(settings, redis),
            )
            jobs.append(relay.run())
        await asyncio.gather(*jobs)
    finally:
        await scripts.aclose()
        await redis.aclose()


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
            await directory.create_principal(principal)
            issued = await directory.issue_token(args.id)
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


def main(argv: Sequence[str] | None = None) -> int:
    from service.errors import ServiceError

    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if args.command == "serve":
        serve(settings)
        return 0
    job: Coroutine[Any, Any, Any]
    if args.command == "sweep":
        job = background(settings, once=args.once, sweeper_only=True)
    elif args.command == "worker":
        job = background(settings)
    else:
        job = admin(settings, args)
    try:
        result = asyncio.run(job)
    except ServiceError as exc:
        print(f"error: {exc.detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if result is not None:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
