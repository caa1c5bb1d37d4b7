"""A/B of two versions of the service: CPU per request, which wrk's requests/s hides in noise.

    python -m bench.ab --old <git revision> [--script SCENARIO] [--rounds 5] [--seconds 5]
                       [--old-env QS_X=1,QS_Y=2] [--new-env QS_X=1,QS_Y=2]

Starts one Redis and two `serve` processes on it: this checkout and `--old` (a temporary git
worktree, the old process's working directory, which `python -m` imports from first). Each has its
own key prefix, so neither's outbox consumers work for the other. wrk -c64 then alternates between
them (2 s of warm-up, then the measured run, the order flipped every round), and each run's
process CPU from /proc is divided by its requests. Prints each round and the medians. Between
two identical processes the medians differ by 1-3 % here (docs/benchmarks.md, "Findings of
2026-12-04, fourth session"). Every run must get only 2xx replies, or it stops. `--old-env` and
`--new-env` give one side other service settings: `--old HEAD --new-env QS_RUN_DELIVERY=false`
prices the in-process webhook fan-out.

SCENARIO (the wrk script in bench/wrk/):
    fetch        GET /v1/questions/{id} by the asking agent, over 32 pending questions
    room-fetch   the same questions asked in a room, fetched by a member (a membership read each)
    room-tap     that member answering them over and over: the first tap on each applies, the
                 rest are stale taps that get the resolved state (answer.lua)
    list         the agent's newest page of 20 (list.lua)
    room-batch   the member's batch wait (timeout 0) over all of those room questions at once
    create       POST /v1/questions by the agent
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.loadgen import run_wrk
from bench.procs import ADMIN_TOKEN, ROOT, RedisProc, ServiceProc, cpu_seconds
from bench.seed import OPTIONS, PROMPT, principal

SEEDED_QUESTIONS = 32  # fetch cycles through these


@dataclass(frozen=True)
class Scenario:
    wrk_script: str  # in bench/wrk/
    in_room: bool = False  # the seeded questions are asked in alice's room, not of alice
    member_reads: bool = False  # alice, not the agent, sends fetch.lua's requests


SCENARIOS = {
    "fetch": Scenario("fetch"),
    "room-fetch": Scenario("fetch", in_room=True, member_reads=True),
    "room-tap": Scenario("answer", in_room=True),
    "list": Scenario("list"),
    "room-batch": Scenario("batch_wait", in_room=True, member_reads=True),
    "create": Scenario("create"),
}


@dataclass
class Side:
    name: str
    service: ServiceProc
    env: dict[str, str] = field(default_factory=dict)
    rounds: list[tuple[float, float]] = field(default_factory=list)  # (requests/s, µs CPU/request)


async def seed(url: str, *, room: bool = False) -> tuple[str, str, list[str]]:
    """The tokens of an agent and of the user alice, and a few pending questions for alice (or
    for a room of hers): what the wrk scripts need."""
    agent = await principal(url, ADMIN_TOKEN, "bench-agent", "agent")
    alice = await principal(url, ADMIN_TOKEN, "alice", "user")
    to = {"user": "alice"}
    if room:
        to = {"room": "bench-room"}
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        put = f"{url}/v1/admin/rooms/bench-room"
        async with (
            aiohttp.ClientSession(headers=admin) as http,
            http.put(put, json={"members": ["alice"]}) as reply,
        ):
            if reply.status != 200:
                raise RuntimeError(f"seeding the room: {reply.status} {await reply.text()}")
    ids = []
    body = {"prompt": PROMPT, "options": OPTIONS, "to": to, "expires_in": 3600}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {agent}"}) as http:
        for _ in range(SEEDED_QUESTIONS):
            async with http.post(f"{url}/v1/questions", json=body) as reply:
                if reply.status != 201:
                    raise RuntimeError(f"seeding: {reply.status} {await reply.text()}")
                ids.append((await reply.json())["id"])
    return agent, alice, ids


def measure(side: Side, script: str, seconds: float) -> None:
    run_wrk(side.service.url, script, seconds=2, connections=64, env=side.env)  # warm-up
    before = cpu_seconds(side.service.pid)
    result = run_wrk(side.service.url, script, seconds=seconds, connections=64, env=side.env)
    used = cpu_seconds(side.service.pid) - before
    if result.error_total or result.non_2xx:  # a cheap refusal is not the route being measured
        raise RuntimeError(f"{side.name}: {result.non_2xx} non-2xx replies, errors {result.errors}")
    side.rounds.append((result.rps, used / result.requests * 1e6))
    print(f"  {side.name}: {result.rps:,.0f} req/s, {side.rounds[-1][1]:.1f} µs CPU/request", flush=True)


def settings_of(pairs: str) -> dict[str, str]:
    """ "QS_X=1,QS_Y=2" -> {"x": "1", "y": "2"}, as ServiceProc takes them."""
    found = {}
    for pair in filter(None, (p.strip() for p in pairs.split(","))):
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("QS_"):
            raise SystemExit(f"not a QS_NAME=value pair: {pair!r}")
        found[name.removeprefix("QS_").lower()] = value
    return found


def run(
    old: str, scenario: Scenario, rounds: int, seconds: float, envs: tuple[str, str] = ("", "")
) -> list[Side]:
    work = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    tree = work / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), old], check=True)
    redis = RedisProc(work).start()
    sides: list[Side] = []
    try:
        named = (
            (f"old {old} {envs[0]}".strip(), tree, "ab-old"),
            (f"this checkout {envs[1]}".strip(), ROOT, "ab-new"),
        )
        for (name, cwd, prefix), env in zip(named, envs, strict=True):
            service = ServiceProc(work, redis.url, name=prefix, key_prefix=prefix, **settings_of(env))
            service.cwd = cwd
            sides.append(Side(name, service.start()))
        for side in sides:
            agent, alice, ids = asyncio.run(seed(side.service.url, room=scenario.in_room))
            ids_file = work / f"{side.service.name}-ids.txt"
            ids_file.write_text("\n".join(ids) + "\n")
            side.env = {
                "BENCH_AGENT_TOKEN": alice if scenario.member_reads else agent,
                "BENCH_USER_TOKEN": alice,
                "BENCH_USER": "alice",
                "BENCH_IDS_FILE": str(ids_file),
            }
        for r in range(rounds):
            print(f"round {r + 1} of {rounds}", flush=True)
            for side in sides if r % 2 == 0 else sides[::-1]:
                measure(side, scenario.wrk_script, seconds)
    finally:
        for side in sides:
            side.service.stop()
        redis.stop()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the git revision to compare this checkout with")
    parser.add_argument("--script", default="fetch", choices=list(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--old-env", default="", help="other service settings of the old side: QS_X=1,QS_Y=2")
    parser.add_argument("--new-env", default="", help="the same for this checkout's side")
    args = parser.parse_args()
    sides = run(args.old, SCENARIOS[args.script], args.rounds, args.seconds, (args.old_env, args.new_env))
    print(f"\n{args.script}, medians of {args.rounds} rounds:")
    for side in sides:
        rps = statistics.median(r for r, _ in side.rounds)
        cpu = statistics.median(c for _, c in side.rounds)
        print(f"  {side.name}: {rps:,.0f} req/s, {cpu:.1f} µs CPU/request")


if __name__ == "__main__":
    sys.exit(main())
