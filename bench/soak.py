"""`make soak`: a bounded soak of one service process against its own redis-server.

A mixed load at a fixed rate (creates, answers by eligible and ineligible users, duplicate taps,
cancels, long-polls, fetches, lists, idempotent retries, and short deadlines left to expire),
with the one-terminal-story invariants checked on every reply and the stats counters checked
every few seconds and exactly at the end. Prints requests/s, errors by kind, p99 latency per
operation, service RSS and Redis memory at start, half-way and end. Exit 1 when an invariant broke.

    python -m bench.soak --seconds 60 --rate 200
    make soak SOAK_SECONDS=60 SOAK_RATE=200
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import json
import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from bench.procs import ADMIN_TOKEN, ROOT, RedisProc, ServiceProc, raise_fd_limit, status_kib
from service.keys import BUCKETS, Keys

PREFIX = "soak"
AGENTS = [f"agent{i}" for i in range(4)]
USERS = [f"user{i}" for i in range(8)]
ROOMS = {"ops": USERS[:4], "dev": USERS[3:7]}
OPTIONS = ("yes", "no", "later")
STATS = ("created", "answered", "expired", "cancelled", "stale")
# The share of each operation in the load (weights).
MIX = {"create": 30, "answer": 25, "cancel": 7, "wait": 15, "fetch": 15, "list": 3, "idempotent": 5}
STATS_EVERY = 5.0


def wire(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_ms(text: str) -> int:
    """Milliseconds since the epoch of an envelope timestamp (RFC 3339 UTC with ms)."""
    whole, millis = text[:-1].split(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) * 1000 + int(millis)


@dataclass
class Tracked:
    """What the soak knows of one question it created."""

    id: str
    asker: str
    to_kind: str
    to_id: str
    options: list[str]
    expires_ms: int
    terminal_wire: str | None = None
    state: str = "pending"
    resolved_ms: int = 0
    applied: int = 0
    terminal_seq: int = 0  # Soak.seq when the terminal story was first seen

    def responders(self) -> list[str]:
        return [self.to_id] if self.to_kind == "user" else ROOMS[self.to_id]


@dataclass
class Tally:
    ok: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    violations: list[str] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)  # transitions sent (stats upper bounds)
    done: Counter[str] = field(default_factory=Counter)
    created: int = 0
    applied_answers: int = 0
    applied_cancels: int = 0
    stale: int = 0

    def violate(self, message: str) -> None:
        if len(self.violations) < 50:
            print("INVARIANT BROKEN:", message, file=sys.stderr)
        self.violations.append(message)


class Soak:
    def __init__(self, url: str, redis: Redis, retention: float, tokens: dict[str, str]) -> None:
        self.url = url
        self.redis = redis
        self.retention_ms = int(retention * 1000)
        self.tokens = tokens
        self.keys = Keys(PREFIX)
        self.tally = Tally()
        self.questions: dict[str, Tracked] = {}
        self.open: list[str] = []  # ids not yet seen terminal (pruned lazily)
        self.gone: list[Tracked] = []  # purged after retention
        # Counts terminal observations: a read sent after a question was seen terminal must not
        # show it pending, but one sent before may (its reply can arrive later).
        self.seq = 0
        self.session: aiohttp.ClientSession | None = None

    # -- HTTP -----------------------------------------------------------------------------------

    async def call(
        self,
        op: str,
        method: str,
        path: str,
        who: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        assert self.session is not None
        sent = {"Authorization": f"Bearer {self.tokens[who]}", **(headers or {})}
        started = time.perf_counter()
        try:
            async with self.session.request(method, self.url + path, json=body, headers=sent) as r:
                payload = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.tally.errors[f"{op}: {type(exc).__name__}"] += 1
            return 0, None
        self.tally.latency[op].append(time.perf_counter() - started)
        decoded = json.loads(payload) if payload else None
        if status >= 500:
            self.tally.violate(f"{op} {path}: {status} {decoded}")
        return status, decoded

    def expect(self, op: str, status: int, wanted: int, body: Any) -> bool:
        if status == wanted:
            self.tally.ok[op] += 1
            return True
        if status:
            self.tally.errors[f"{op}: HTTP {status}"] += 1
            if status < 500:
                self.tally.violate(f"{op}: expected {wanted}, got {status}: {body}")
        return False

    # -- invariants -----------------------------------------------------------------------------

    def observe(self, q: Tracked, env: dict[str, Any], where: str, sent_seq: int | None = None) -> None:
        """Every envelope of a question tells the same story once it is terminal. `sent_seq`:
        self.seq when the request was sent (None: a transition reply, never pending here)."""
        v = self.tally.violate
        if env.get("id") != q.id:
            v(f"{where}: envelope of {env.get('id')} for {q.id}")
            return
        state = env["state"]
        if state == "pending":
            if q.terminal_wire is not None and (sent_seq is None or q.terminal_seq <= sent_seq):
                v(f"{where}: {q.id} pending again after {q.state}")
            return
        text = wire(env)
        if q.terminal_wire is not None:
            if text != q.terminal_wire:
                v(f"{where}: terminal envelope of {q.id} changed:\n{q.terminal_wire}\n{text}")
            return
        self.seq += 1
        q.terminal_wire, q.state, q.terminal_seq = text, state, self.seq
        q.resolved_ms = parse_ms(env["resolved_at"])
        self.check_story(q, env, where)

    def check_story(self, q: Tracked, env: dict[str, Any], where: str) -> None:
        v = self.tally.violate
        answer, cancellation = env["answer"], env["cancellation"]
        if env["version"] != 2:
            v(f"{where}: terminal {q.id} has version {env['version']}")
        if env["state"] == "answered":
            if cancellation is not None or answer is None:
                v(f"{where}: answered {q.id} with {answer} / {cancellation}")
            elif answer["responder"] not in q.responders() or answer["option"] not in q.options:
                v(f"{where}: {q.id} answered by {answer['responder']} with {answer['option']}")
            elif answer["answered_at"] != env["resolved_at"] or q.resolved_ms >= q.expires_ms:
                v(f"{where}: {q.id} answered at {answer['answered_at']}, deadline {env['expires_at']}")
        elif env["state"] == "expired":
            if answer is not None or cancellation is not None or env["resolved_at"] != env["expires_at"]:
                v(f"{where}: expired {q.id} tells {answer} / {cancellation} / {env['resolved_at']}")
        elif env["state"] == "cancelled":
            if answer is not None or cancellation is None or cancellation["by"] != q.asker:
                v(f"{where}: cancelled {q.id} tells {answer} / {cancellation}")
            elif q.resolved_ms >= q.expires_ms:
                v(f"{where}: {q.id} cancelled at {env['resolved_at']}, deadline {env['expires_at']}")

    def tapped(self, q: Tracked, kind: str, who: str, option: str, reply: dict[str, Any]) -> None:
        env, applied = reply["question"], reply["applied"]
        self.observe(q, env, kind)
        if not applied:
            self.tally.stale += 1
            if env["state"] == "pending":
                self.tally.violate(f"{kind}: not applied but {q.id} is still pending")
            return
        q.applied += 1
        if q.applied > 1:
            self.tally.violate(f"{q.id}: applied:true {q.applied} times")
        if kind == "answer":
            self.tally.applied_answers += 1
            if (
                env["state"] != "answered"
                or env["answer"]["responder"] != who
                or env["answer"]["option"] != option
            ):
                self.tally.violate(f"answer by {who} ({option}) applied but the story is {env}")
        else:
            self.tally.applied_cancels += 1
            if env["state"] != "cancelled" or env["cancellation"]["by"] != who:
                self.tally.violate(f"cancel by {who} applied but the story is {env}")

    def vanished(self, q: Tracked, where: str, now_ms: int) -> None:
        """404 for a question of ours: only after its retention has run out."""
        self.tally.ok[f"{where} (purged)"] += 1
        if self.questions.pop(q.id, None) is None:
            return  # another request found it gone first
        resolved = q.resolved_ms if q.terminal_wire is not None else q.expires_ms
        if now_ms < resolved + self.retention_ms - 1000:
            self.tally.violate(f"{where}: {q.id} ({q.state}) gone before its retention ran out")
        self.gone.append(q)

    # -- operations -----------------------------------------------------------------------------

    def pick_open(self) -> Tracked | None:
        while self.open:
            i = random.randrange(len(self.open))
            q = self.questions.get(self.open[i])
            if q is not None and q.terminal_wire is None:
                return q
            self.open[i] = self.open[-1]
            self.open.pop()
        return None

    def pick_any(self) -> Tracked | None:
        if not self.questions:
            return None
        ids = list(self.questions)[-2000:]
        return self.questions[random.choice(ids)]

    def ask_body(self) -> dict[str, Any]:
        to = {"user": random.choice(USERS)} if random.random() < 0.6 else {"room": random.choice(list(ROOMS))}
        expires_in = random.choice((1, 2, 3)) if random.random() < 0.3 else random.randint(5, 60)
        return {
            "prompt": "Soak?",
            "options": [{"id": o, "label": o.title()} for o in OPTIONS],
            "to": to,
            "expires_in": expires_in,
            "metadata": {"n": random.randrange(1000)},
        }

    async def create(self, key: str | None = None) -> None:
        asker, body = random.choice(AGENTS), self.ask_body()
        headers = {"Idempotency-Key": key} if key else None
        self.tally.sent["create"] += 1
        status, env = await self.call("create", "POST", "/v1/questions", asker, body, headers)
        self.tally.done["create"] += 1
        if not self.expect("create", status, 201, env):
            return
        self.track(asker, env)
        self.tally.created += 1
        if key is None:
            return
        sent_seq = self.seq
        status, again = await self.call("idempotent", "POST", "/v1/questions", asker, body, headers)
        if self.expect("idempotent", status, 200, again) and again["id"] != env["id"]:
            self.tally.violate(f"Idempotency-Key {key} replayed {again['id']} for {env['id']}")
        elif status == 200:
            self.observe(self.questions[env["id"]], again, "idempotent replay", sent_seq)

    def track(self, asker: str, env: dict[str, Any]) -> None:
        ((kind, target),) = env["to"].items()
        q = Tracked(
            env["id"], asker, kind, target, [o["id"] for o in env["options"]], parse_ms(env["expires_at"])
        )
        if env["id"] in self.questions or env["state"] != "pending":
            self.tally.violate(f"create: {env['id']} is not a new pending question")
        self.questions[q.id] = q
        self.open.append(q.id)

    async def answer(self) -> None:
        q = self.pick_open()
        if q is None:
            return await self.create()
        option = random.choice(q.options)
        path = f"/v1/questions/{q.id}/answer"
        if random.random() < 0.15:
            outsiders = [u for u in USERS if u not in q.responders()]
            status, body = await self.call(
                "answer (ineligible)", "POST", path, random.choice(outsiders), {"option": option}
            )
            self.expect("answer (ineligible)", status, 404, body)
            return None
        who = random.choice(q.responders())
        taps = 2 if random.random() < 0.15 else 1  # a duplicate tap right behind the first
        for _ in range(taps):
            self.tally.sent["answer"] += 1
            status, reply = await self.call("answer", "POST", path, who, {"option": option})
            self.tally.done["answer"] += 1
            if status == 404:
                self.vanished(q, "answer", await self.redis_ms())
            elif self.expect("answer", status, 200, reply):
                self.tapped(q, "answer", who, option, reply)
        return None

    async def cancel(self, q: Tracked | None = None, op: str = "cancel") -> None:
        q = q or self.pick_open()
        if q is None:
            return
        self.tally.sent["cancel"] += 1
        status, reply = await self.call(
            op, "POST", f"/v1/questions/{q.id}/cancel", q.asker, {"reason": "soak"}
        )
        self.tally.done["cancel"] += 1
        if status == 404:
            self.vanished(q, op, await self.redis_ms())
        elif self.expect(op, status, 200, reply):
            self.tapped(q, "cancel", q.asker, "", reply)

    async def read(self, op: str) -> None:
        q = self.pick_open() if op == "wait" else self.pick_any()
        if q is None:
            return
        path = f"/v1/questions/{q.id}"
        if op == "wait":
            path += f"/wait?timeout={random.choice((0.2, 0.5, 1, 2))}"
        sent_seq = self.seq
        status, env = await self.call(op, "GET", path, q.asker)
        if status == 404:
            self.vanished(q, op, await self.redis_ms())
        elif self.expect(op, status, 200, env):
            self.observe(q, env, op, sent_seq)

    async def list_page(self) -> None:
        asker, sent_seq = random.choice(AGENTS), self.seq
        status, page = await self.call("list", "GET", "/v1/questions?limit=20", asker)
        if not self.expect("list", status, 200, page):
            return
        for env in page["items"]:
            q = self.questions.get(env["id"])
            if q is not None:
                self.observe(q, env, "list", sent_seq)

    async def one(self) -> None:
        op = random.choices(list(MIX), weights=list(MIX.values()))[0]
        if op == "create":
            await self.create()
        elif op == "idempotent":
            await self.create(uuid.uuid4().hex)
        elif op == "answer":
            await self.answer()
        elif op == "cancel":
            await self.cancel()
        elif op == "list":
            await self.list_page()
        else:
            await self.read(op)

    # -- Redis-side checks ----------------------------------------------------------------------

    async def redis_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def stats(self) -> dict[str, int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in range(BUCKETS):
                pipe.hgetall(self.keys.stats(b))
            hashes = await pipe.execute()
        return {name: sum(int(h.get(name, 0)) for h in hashes) for name in STATS}

    async def check_stats(self, final: bool) -> dict[str, int]:
        """The counters agree with what the replies said (bounds while requests are in flight,
        exact once everything is terminal and nothing is in flight)."""
        t = self.tally
        # Replies seen before the read committed before it (lower bounds); whatever committed
        # before it was answered by now, is still in flight, or failed (upper bounds).
        lows = {"created": t.created, "answered": t.applied_answers, "cancelled": t.applied_cancels}
        lows["stale"] = t.stale
        s = await self.stats()
        unsure = {
            op: t.sent[op] - t.done[op] + sum(v for k, v in t.errors.items() if op in k) for op in t.sent
        }
        highs = {
            "created": t.created + unsure.get("create", 0),
            "answered": t.applied_answers + unsure.get("answer", 0),
            "cancelled": t.applied_cancels + unsure.get("cancel", 0),
            "stale": t.stale + unsure.get("answer", 0) + unsure.get("cancel", 0),
        }
        bounds = {name: (lows[name], highs[name]) for name in lows}
        for name, (low, high) in bounds.items():
            if not low <= s[name] <= high:
                t.violate(f"stats {name} = {s[name]}, replies say [{low}, {high}]")
        resolved = s["answered"] + s["expired"] + s["cancelled"]
        if resolved > s["created"] or (final and resolved != s["created"]):
            t.violate(f"stats: {resolved} terminal stories for {s['created']} questions (final={final})")
        if final:
            known = [q for q in [*self.questions.values(), *self.gone] if q.terminal_wire is not None]
            seen_expired = sum(q.state == "expired" for q in known)
            unseen = sum(q.terminal_wire is None for q in self.gone)
            if not seen_expired <= s["expired"] <= seen_expired + unseen:
                t.violate(
                    f"stats expired = {s['expired']}, replies say [{seen_expired}, {seen_expired + unseen}]"
                )
        return s

    async def process(self, service: ServiceProc) -> dict[str, int]:
        """The service's RSS, and the questions its bounded target cache holds (qs_cache_entries):
        that cache grows the RSS by ~350 B per entry until it is full (docs/operations.md)."""
        assert self.session is not None
        async with self.session.get(self.url + "/metrics") as reply:
            text = await reply.text()
        found = re.search(r'^qs_cache_entries\{cache="question_targets"\} (\S+)$', text, re.M)
        return {"rss_kib": status_kib(service.pid), "cached_targets": int(float(found[1])) if found else -1}

    async def memory(self) -> dict[str, int]:
        """Redis used_memory and what its keys account for, by kind."""
        info = await self.redis.info("memory")
        scan_started_ms = await self.redis_ms()  # the scan below can take seconds: keep both ends
        sizes: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        keys = [key async for key in self.redis.scan_iter(count=1000)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.memory_usage(key, samples=0)
            usage = await pipe.execute()
        streams = [key for key in keys if key.endswith(("outbox", "events"))]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in streams:
                pipe.xlen(key)
            entries = sum(await pipe.execute())
        for key, used in zip(keys, usage, strict=True):
            kind = (
                "questions" if ":q:" in key else "streams" if key.endswith(("outbox", "events")) else "other"
            )
            sizes[kind] += int(used or 0)
            counts[kind] += 1
        return {
            "used_memory": int(info["used_memory"]),
            "keys_bytes": sum(sizes.values()),
            **{f"{k}_bytes": sizes[k] for k in ("questions", "streams", "other")},
            "question_hashes": counts["questions"],
            "stream_entries": entries,
            "scan_started_ms": scan_started_ms,
            "redis_ms": await self.redis_ms(),
        }


async def setup(url: str) -> dict[str, str]:
    tokens = {"admin": ADMIN_TOKEN}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as s:
        for pid, kind in [*((a, "agent") for a in AGENTS), *((u, "user") for u in USERS)]:
            async with s.post(url + "/v1/admin/principals", json={"id": pid, "kind": kind}) as r:
                assert r.status == 201, await r.text()
                tokens[pid] = (await r.json())["token"]
        for room, members in ROOMS.items():
            async with s.put(f"{url}/v1/admin/rooms/{room}", json={"members": members}) as r:
                assert r.status == 200, await r.text()
    return tokens


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000 if ordered else 0.0


async def drive(
    soak: Soak, seconds: float, rate: float, max_inflight: int, service: ServiceProc
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    snapshots = {"start": {**await soak.memory(), **await soak.process(service)}}
    start = loop.time()
    next_tick, next_stats, half_done = start, start + STATS_EVERY, False
    while loop.time() < start + seconds:
        if len(tasks) < max_inflight:
            task = asyncio.create_task(soak.one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        else:
            soak.tally.errors["behind (in-flight limit)"] += 1
        if loop.time() >= next_stats:
            await soak.check_stats(final=False)
            next_stats += STATS_EVERY
        if not half_done and loop.time() >= start + seconds / 2:
            half_done = True
            snapshots["half"] = {**await soak.memory(), **await soak.process(service)}
        if not service.alive():
            soak.tally.violate("the service process died:\n" + service.log_tail())
            break
        next_tick += 1 / rate
        await asyncio.sleep(max(0.0, next_tick - loop.time()))
    elapsed = loop.time() - start
    await asyncio.gather(*tasks, return_exceptions=False)
    requests = sum(len(v) for v in soak.tally.latency.values())
    # Leave nothing pending: the asker cancels whatever is still open; then every story is told.
    for q in list(soak.questions.values()):
        if q.terminal_wire is None:
            await soak.cancel(q, "final cancel")
    snapshots["end"] = {**await soak.memory(), **await soak.process(service)}
    stats = await soak.check_stats(final=True)
    channels = await waiter_channels(soak)
    if channels:
        soak.tally.violate(f"{channels} question channels still subscribed after every wait returned")
    return {"elapsed": elapsed, "requests": requests, "stats": stats, "memory": snapshots}


async def waiter_channels(soak: Soak) -> int:
    """Question channels the service still subscribes once no wait is parked (it unsubscribes in
    the background, so give it a moment)."""
    for _ in range(50):
        channels = await soak.redis.pubsub_channels(f"{PREFIX}:*:ch:*")
        if not channels:
            return 0
        await asyncio.sleep(0.1)
    return len(channels)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_line(when: str, m: dict[str, int]) -> str:
    return (
        f"{when:>5}: service RSS {m['rss_kib'] / 1024:.1f} MiB"
        f" ({m['cached_targets']} cached question targets); Redis used_memory {mib(m['used_memory'])}"
        f" = keys {mib(m['keys_bytes'])} (questions {m['question_hashes']}: {mib(m['questions_bytes'])},"
        f" streams {m['stream_entries']} entries: {mib(m['streams_bytes'])}, other {mib(m['other_bytes'])})"
        f" + not in keys {mib(m['used_memory'] - m['keys_bytes'])}"
    )


def retention_explains(soak: Soak, end: dict[str, int]) -> tuple[int, int]:
    """How many question hashes the retention window explains at the end: those resolved
    within it must still be there; those resolved before it (plus a sweep's slack) must not.
    The hashes were counted between the scan's start and end, so each bound takes its own end."""
    window = soak.retention_ms
    resolved = [q.resolved_ms for q in soak.questions.values() if q.terminal_wire is not None]
    must = sum(r > end["redis_ms"] - window + 1000 for r in resolved)
    may = sum(r > end["scan_started_ms"] - window - 3000 for r in resolved)
    return must, may


def report(soak: Soak, result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    t, mem = soak.tally, result["memory"]
    rate = result["requests"] / result["elapsed"]
    lines = [
        f"soak: {args.seconds:g} s at {args.rate:g} ops/s target, retention {args.retention:g} s",
        f"requests: {result['requests']} in {result['elapsed']:.1f} s = {rate:.0f} req/s",
        f"questions created: {t.created}; stats: {result['stats']}",
        f"errors: {dict(t.errors) or 'none'}",
        "p99 latency (ms): "
        + ", ".join(f"{op} {p99(v):.1f} (n={len(v)})" for op, v in sorted(t.latency.items())),
        *(memory_line(when, mem[when]) for when in ("start", "half", "end") if when in mem),
    ]
    start, end = mem["start"], mem["end"]
    must, may = retention_explains(soak, end)
    hashes = end["question_hashes"]
    if not must <= hashes <= may:
        t.violate(f"{hashes} question hashes at the end; the retention window explains [{must}, {may}]")
    growth = (end["used_memory"] - end["keys_bytes"]) - (start["used_memory"] - start["keys_bytes"])
    lines.append(
        f"question hashes at the end: {hashes}, the retention window explains {must}..{may};"
        f" streams (outbox and event streams, capped by QS_OUTBOX_MAXLEN / QS_EVENTS_MAXLEN)"
        f" {mib(end['streams_bytes'])}; Redis memory not held by any key grew {growth / 2**20:+.1f} MiB"
        f" ({'beyond' if growth > 8 * 2**20 else 'within'} an 8 MiB allowance)"
    )
    lines.append(f"invariants: {'BROKEN (' + str(len(t.violations)) + ')' if t.violations else 'all held'}")
    print("\n".join(lines))
    return {
        "seconds": args.seconds,
        "rate": args.rate,
        "requests_per_second": result["requests"] / result["elapsed"],
        "errors": dict(t.errors),
        "p99_ms": {op: p99(v) for op, v in t.latency.items()},
        "stats": result["stats"],
        "memory": mem,
        "violations": t.violations[:50],
    }


async def run(args: argparse.Namespace) -> int:
    raise_fd_limit()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    redis_proc = RedisProc(workdir).start()
    service: ServiceProc | None = None
    redis = Redis.from_url(redis_proc.url, decode_responses=True)
    try:
        service = ServiceProc(
            workdir,
            redis_proc.url,
            key_prefix=PREFIX,
            retention_seconds=str(int(args.retention)),
            wait_max_seconds="10",
            wait_default_seconds="5",
        ).start()
        tokens = await setup(service.url)
        soak = Soak(service.url, redis, args.retention, tokens)
        connector = aiohttp.TCPConnector(limit=args.max_inflight)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            soak.session = session
            result = await drive(soak, args.seconds, args.rate, args.max_inflight, service)
        summary = report(soak, result, args)
        out = ROOT / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(summary, indent=2))
        log = service.log_tail(200_000)
        if "Traceback" in log:
            print("the service logged a traceback:\n" + log[-4000:], file=sys.stderr)
            return 1
        return 1 if soak.tally.violations else 0
    finally:
        await redis.aclose()
        if service is not None:
            service.stop()
        redis_proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--rate", type=float, default=200, help="operations started per second")
    parser.add_argument(
        "--retention", type=float, default=None, help="QS_RETENTION_SECONDS (default: seconds/6, >= 10)"
    )
    parser.add_argument("--max-inflight", type=int, default=400)
    args = parser.parse_args()
    if args.retention is None:
        args.retention = max(10.0, args.seconds // 6)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
