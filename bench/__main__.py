"""`python -m bench` (or `make bench`): every scenario of issue 3 in one run, one table at the end.

It starts its own redis-server, the service and the bare aiohttp baseline, drives them, stops
them, prints the table and rewrites the generated section of docs/benchmarks.md. Targets are
reported as met / not met; nothing here fails because the machine is slow. Settings: see
HAND_WRITTEN_HEAD in bench/report.py (BENCH_* environment variables).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from bench import seed
from bench.loadgen import WrkResult, run_wrk
from bench.procs import (
    ADMIN_TOKEN,
    ROOT,
    BaselineProc,
    LadderProc,
    RedisProc,
    ServiceProc,
    cpu_seconds,
    raise_fd_limit,
)
from bench.report import Report, Row, machine, text_table, write_doc

AGENT, USER = "bench-agent", "bench-user"
RESULTS = ROOT / "bench" / "results"


def _env_list(name: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, default).replace(" ", "").split(",") if x]


@dataclass
class Config:
    seconds: float = float(os.environ.get("BENCH_SECONDS", "8"))
    rounds: int = max(1, int(os.environ.get("BENCH_ROUNDS", "3")))
    connections: int = int(os.environ.get("BENCH_CONNECTIONS", "64"))
    threads: int = int(os.environ.get("BENCH_THREADS", "1"))
    waiters: list[int] = field(default_factory=lambda: _env_list("BENCH_WAITERS", "1000,10000"))
    wait_rate: float = float(os.environ.get("BENCH_WAIT_RATE", "500"))
    sweep: int = int(os.environ.get("BENCH_SWEEP", "100000"))
    peer_seconds: float = float(os.environ.get("BENCH_PEER_SECONDS", "5"))
    peer_concurrency: int = int(os.environ.get("BENCH_PEER_CONCURRENCY", "16"))
    pg_url: str = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    skip: set[str] = field(
        default_factory=lambda: {s for s in os.environ.get("BENCH_SKIP", "").split(",") if s}
    )
    access_log: bool = os.environ.get("BENCH_ACCESS_LOG", "") in ("1", "true", "yes")
    profile: bool = os.environ.get("BENCH_PROFILE", "") in ("1", "true", "yes")
    write_doc: bool = os.environ.get("BENCH_WRITE_DOC", "1") not in ("0", "false", "no")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


LADDER_RUNGS = ("script", "read")


@dataclass
class Scenario:
    """One wrk scenario over the rounds: each round's run, its server CPU share, Redis' CPU per
    request and its ratio to the baseline of its own round (the machine's speed drifts between
    rounds; a ratio within one round does not)."""

    runs: list[WrkResult] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    redis_us: list[float] = field(default_factory=list)
    bases: list[float] = field(default_factory=list)

    def add(self, run: WrkResult, measured: dict[str, Any], base: float) -> None:
        self.runs.append(run)
        self.cpu.append(measured["process_cpu"] or 0.0)
        self.redis_us.append(measured["redis_us_per_request"])
        self.bases.append(base)

    @property
    def ratios(self) -> list[float]:
        return [run.rps / base for run, base in zip(self.runs, self.bases, strict=True)]

    def ratio_list(self) -> str:
        return " / ".join(f"{ratio:.2f}" for ratio in self.ratios)

    def values(self, attr: str) -> list[float]:
        return [float(getattr(run, attr)) for run in self.runs]

    def median(self, attr: str) -> float:
        return statistics.median(self.values(attr))

    def max(self, attr: str) -> float:
        return max(self.values(attr))

    def row(self, name: str, target: str, notes: str, *, order: int) -> Row:
        ratio = f"{statistics.median(self.ratios):.2f}"
        p50, p99 = self.median("p50_ms"), self.median("p99_ms")
        return Row(name, self.median("rps"), p50, p99, self.max("max_ms"), ratio, target, notes, order=order)


class Bench:
    def __init__(self, cfg: Config, workdir: Path) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.report = Report()
        self.redis: RedisProc | None = None
        self.service: ServiceProc | None = None
        self.baseline: BaselineProc | None = None
        self.extra: list[Any] = []
        self.agent_token = ""
        self.user_token = ""
        self.baseline_rps: list[float] = []
        # Per waiter run: (name, lost of measured, measured, lost of warm-up, warm-up).
        self.lost_wakeups: list[tuple[str, int, int, int, int]] = []
        self.results: dict[str, Any] = {}

    # -- plumbing ---------------------------------------------------------------------------------

    def redis_client(self) -> Redis:
        assert self.redis is not None
        return Redis.from_url(self.redis.url, decode_responses=True)

    def redis_cpu(self) -> float:
        with self.redis_client() as r:
            info = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def stats(self, field_name: str) -> int:
        from service.keys import BUCKETS, Keys

        keys = Keys("qs")
        with self.redis_client() as r, r.pipeline(transaction=False) as pipe:
            for b in range(BUCKETS):
                pipe.hget(keys.stats(b), field_name)
            return sum(int(v or 0) for v in pipe.execute())

    def new_ids(self, count: int) -> list[str]:
        assert self.redis is not None
        assert self.service is not None
        ids, how, seconds = seed.create_questions(
            redis_url=self.redis.url,
            base_url=self.service.url,
            agent_token=self.agent_token,
            asker=AGENT,
            user=USER,
            count=count,
        )
        log(f"  pre-created {len(ids)} pending questions via {how} in {seconds:.1f} s")
        return ids

    def ids_file(self, name: str, ids: list[str]) -> str:
        path = self.workdir / f"{name}.ids"
        seed.write_ids(path, ids)
        return str(path)

    def settle(self, *procs: Any, quiet: float = 0.15, limit: float = 60.0) -> float:
        """Wait until the processes are idle: background work a step left behind (the event relay
        catching up on pre-created questions' outbox events, say) must not land in the next."""
        started = time.perf_counter()
        pids = [p.pid for p in procs if p is not None and p.alive()]
        while pids and time.perf_counter() - started < limit:
            before = [cpu_seconds(pid) for pid in pids]
            time.sleep(0.5)
            busiest = max((cpu_seconds(pid) - b) / 0.5 for pid, b in zip(pids, before, strict=True))
            if busiest < quiet:
                break
        waited = time.perf_counter() - started
        if waited > 1.5:
            log(f"  waited {waited:.1f} s for the service to finish background work")
        return waited

    def wrk(
        self, name: str, url: str, script: str, env: dict[str, str] | None = None, *, pid: int | None = None
    ) -> WrkResult:
        """One wrk run with the server's and Redis' CPU use over it (and a profile if asked);
        the server is the service or the baseline by its URL, else the process `pid`."""
        if pid is None and self.service is not None and url == self.service.url:
            pid = self.service.pid
        if pid is None and self.baseline is not None and url == self.baseline.url:
            pid = self.baseline.pid
        self.settle(self.service, self.redis)
        profiler = self._profile(name, pid) if self.cfg.profile and pid else None
        cpu0 = cpu_seconds(pid) if pid else 0.0
        redis0 = self.redis_cpu()
        result = run_wrk(
            url,
            script,
            seconds=self.cfg.seconds,
            connections=self.cfg.connections,
            threads=self.cfg.threads,
            env=env,
        )
        result.raw = ""
        self.results.setdefault("wrk", {})[name] = {
            **{k: v for k, v in result.__dict__.items() if k != "raw"},
            "process_cpu": (cpu_seconds(pid) - cpu0) / result.seconds if pid else None,
            "redis_us_per_request": (self.redis_cpu() - redis0) * 1e6 / max(1, result.requests),
        }
        if profiler is not None:
            profiler.wait(timeout=self.cfg.seconds + 30)
        log(
            f"  {name}: {result.rps:,.0f} req/s, p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms,"
            f" errors {result.error_total}, non-2xx {result.non_2xx}"
        )
        return result

    def _profile(self, name: str, pid: int) -> subprocess.Popen[bytes] | None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not Path(spy).exists():
            log("  BENCH_PROFILE: py-spy not found (pip install py-spy)")
            return None
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"profile-{name}.txt"
        args = [
            spy,
            "record",
            "-r",
            "250",
            "-p",
            str(pid),
            "-d",
            str(int(self.cfg.seconds)),
            "-f",
            "raw",
            "-o",
            str(out),
        ]
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def subprocess_json(self, module: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", module],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=timeout,
        )
        if done.returncode != 0 or not done.stdout.strip():
            raise RuntimeError(f"{module} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    # -- the run ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.redis = RedisProc(self.workdir).start()
        self.baseline = BaselineProc(self.workdir).start()
        self.service = ServiceProc(self.workdir, self.redis.url).start()
        self.agent_token = asyncio.run(seed.principal(self.service.url, ADMIN_TOKEN, AGENT, "agent"))
        self.user_token = asyncio.run(seed.principal(self.service.url, ADMIN_TOKEN, USER, "user"))
        with self.redis_client() as r:
            redis_version = str(r.info("server")["redis_version"])
        loop = "uvloop" if _importable("uvloop") else "asyncio"
        self.report.machine = machine(
            redis_version,
            {
                "server event loop (service and baseline)": loop,
                "service settings": "QS_LOG_LEVEL=WARNING QS_WAIT_MAX_SECONDS=600 "
                "QS_WAITS_PER_PRINCIPAL=20000 (else defaults) "
                + os.environ.get("BENCH_SERVICE_ENV", "").replace(",", " "),
            },
        )
        log(f"redis {self.redis.url}, service {self.service.url}, baseline {self.baseline.url}")

    def http_scenarios(self) -> None:
        """create, answer, fetch and the ladder's rungs, in rounds between two baseline runs each;
        every row is the median over the rounds, each ratio taken within its own round."""
        assert self.service is not None
        assert self.baseline is not None
        assert self.redis is not None
        cfg = self.cfg
        few = asyncio.run(
            seed.create_via_http(self.service.url, self.agent_token, USER, 8, 3600, concurrency=8)
        )
        env = {
            "BENCH_AGENT_TOKEN": self.agent_token,
            "BENCH_USER_TOKEN": self.user_token,
            "BENCH_USER": USER,
            "BENCH_IDS_FILE": self.ids_file("fetch", few),
        }
        ladder = LadderProc(self.workdir, self.redis.url).start()
        self.extra.append(ladder)
        log("warm-up (not reported)")
        warm = [(self.baseline.url, {}), (self.service.url, env)]
        warm += [(ladder.url, {**env, "BENCH_FETCH_PATH": f"/{rung}/"}) for rung in LADDER_RUNGS]
        for url, warm_env in warm:
            script = "baseline" if url == self.baseline.url else "fetch"
            run_wrk(url, script, seconds=2, connections=cfg.connections, threads=cfg.threads, env=warm_env)

        log(f"wrk -t{cfg.threads} -c{cfg.connections} -d{cfg.seconds:g}s, {cfg.rounds} round(s)")
        scenarios: dict[str, Scenario] = {}
        applied = stale = 0
        for i in range(1, cfg.rounds + 1):
            log(f"round {i} of {cfg.rounds}")
            runs, round_applied, round_stale = self.http_round(i, env, ladder)
            applied, stale = applied + round_applied, stale + round_stale
            base = (runs["baseline-a"].rps + runs["baseline-b"].rps) / 2
            for name, result in runs.items():
                scenarios.setdefault(name, Scenario()).add(result, self.results["wrk"][f"{name}#{i}"], base)
        ladder.stop()
        self.results["answer_applied"] = {"applied": applied, "stale": stale}
        self.results["median_rps"] = {name: sc.median("rps") for name, sc in scenarios.items()}
        self.baseline_rps = scenarios["baseline-a"].bases
        access = self.access_log_run(env) if cfg.access_log else None
        self.add_http_rows(scenarios, applied, stale, access)

    def http_round(
        self, i: int, env: dict[str, str], ladder: LadderProc
    ) -> tuple[dict[str, WrkResult], int, int]:
        """One round: baseline, create, answer, fetch, the ladder's rungs, baseline again."""
        assert self.service is not None
        assert self.baseline is not None
        runs = {"baseline-a": self.wrk(f"baseline-a#{i}", self.baseline.url, "baseline")}
        runs["create"] = self.wrk(f"create#{i}", self.service.url, "create", env)
        count = int(max(runs["create"].rps, 1000) * 2 * self.cfg.seconds) + 5000
        answer_env = {**env, "BENCH_IDS_FILE": self.ids_file(f"answer-{i}", self.new_ids(count))}
        answered0, stale0 = self.stats("answered"), self.stats("stale")
        runs["answer"] = self.wrk(f"answer#{i}", self.service.url, "answer", answer_env)
        applied, stale = self.stats("answered") - answered0, self.stats("stale") - stale0
        runs["fetch"] = self.wrk(f"fetch#{i}", self.service.url, "fetch", env)
        for rung in LADDER_RUNGS:
            rung_env = {**env, "BENCH_FETCH_PATH": f"/{rung}/"}
            runs[f"ladder-{rung}"] = self.wrk(
                f"ladder-{rung}#{i}", ladder.url, "fetch", rung_env, pid=ladder.pid
            )
        runs["baseline-b"] = self.wrk(f"baseline-b#{i}", self.baseline.url, "baseline")
        return runs, applied, stale

    def access_log_run(self, env: dict[str, str]) -> WrkResult:
        assert self.redis is not None
        cfg = self.cfg
        # INFO: at WARNING the access logger is disabled whatever QS_ACCESS_LOG says.
        noisy = ServiceProc(
            self.workdir, self.redis.url, name="service-access-log", access_log="1", log_level="INFO"
        )
        self.extra.append(noisy.start())
        run_wrk(noisy.url, "fetch", seconds=2, connections=cfg.connections, env=env)
        access = run_wrk(noisy.url, "fetch", seconds=cfg.seconds, connections=cfg.connections, env=env)
        noisy.stop()
        log(f"  fetch with access log: {access.rps:,.0f} req/s")
        return access

    def add_http_rows(
        self, scenarios: dict[str, Scenario], applied: int, stale: int, access: WrkResult | None
    ) -> None:
        r = self.report
        base_a, base_b = scenarios["baseline-a"], scenarios["baseline-b"]
        base = statistics.median(base_a.bases)
        per_round = " / ".join(f"{b:,.0f}" for b in base_a.bases)
        r.add(
            Row(
                "baseline (bare aiohttp)",
                base,
                statistics.median([*base_a.values("p50_ms"), *base_b.values("p50_ms")]),
                statistics.median([*base_a.values("p99_ms"), *base_b.values("p99_ms")]),
                max(base_a.max("max_ms"), base_b.max("max_ms")),
                "1.00",
                "",
                f"each round's baseline is the mean of a run before and after its service runs: {per_round}"
                f" req/s; process CPU {statistics.median(base_a.cpu):.0%}",
                order=0,
            )
        )
        for name, goal in (("create", 0.5), ("answer", 0.5), ("fetch", 0.6)):
            sc = scenarios[name]
            ratio = statistics.median(sc.ratios)
            met = r.target(
                f"{name} >= {goal:.0%} of the baseline's requests/s (one process each, same run)",
                ratio >= goal,
                f"{ratio:.0%} (median of {len(sc.ratios)} rounds: {sc.ratio_list()})",
                order=1,
            )
            notes = [
                f"ratio per round {sc.ratio_list()}",
                f"service CPU {statistics.median(sc.cpu):.0%}",
                f"redis {statistics.median(sc.redis_us):.0f} µs/req",
            ]
            errors = sum(run.error_total + run.non_2xx for run in sc.runs)
            if errors:
                notes.append(f"errors and non-2xx {errors}")
            if name == "answer":
                notes.insert(
                    0,
                    f"applied {applied / max(1, applied + stale):.1%} ({applied:,} applied, {stale:,} stale)",
                )
            r.add(sc.row(name, f">= {goal:.2f}: {met}", "; ".join(notes), order=1))
        self.add_ladder_rows(scenarios)
        if access is not None:
            fetch = self.results["median_rps"]["fetch"]
            r.add(
                Row(
                    "fetch, access log on",
                    access.rps,
                    access.p50_ms,
                    access.p99_ms,
                    access.max_ms,
                    f"{access.rps / base:.2f}",
                    "",
                    f"QS_ACCESS_LOG=1 QS_LOG_LEVEL=INFO (a line per request to a file):"
                    f" {access.rps / fetch - 1:+.0%} vs the median fetch without it",
                    order=2,
                )
            )

    def waiter_scenarios(self) -> None:
        assert self.service is not None
        assert self.redis is not None
        assert self.baseline is not None
        for n in self.cfg.waiters:
            log(f"waiters: N={n} at {self.cfg.wait_rate:g} answers/s")
            ids = self.new_ids(n + 50)
            self.settle(self.service, self.redis)
            job = {
                "wait_urls": [self.service.url],
                "answer_urls": [self.service.url],
                "agent_token": self.agent_token,
                "user_token": self.user_token,
                "ids": ids,
                "warmup": 50,
                "rate": self.cfg.wait_rate,
                "redis_url": self.redis.url,
                "service_pids": [self.service.pid],
                "timeout": 600,
            }
            # Beyond the child's own limits (warm-up 35 s, parking 60 s, answers, 30 s for the
            # stragglers), so a stalled run reports what stalled instead of being killed.
            timeout = 240 + n / self.cfg.wait_rate * 2
            res = self.subprocess_json("bench.waiters", job, timeout)
            self.results.setdefault("waiters", {})[n] = res
            self._waiter_row(f"wait, N={n:,}", res, targets=(n >= 10_000))
        n = max(self.cfg.waiters, default=0)
        if n:
            log(f"bare aiohttp: {n} parked requests")
            res = self.subprocess_json(
                "bench.waiters",
                {"baseline_url": self.baseline.url, "baseline_pid": self.baseline.pid, "n": n},
                180,
            )
            self.results["baseline_park"] = res
            self.report.add(
                Row(
                    f"baseline: {n:,} parked requests",
                    notes=f"RSS {res['rss_per_request_kib']:.1f} KiB per parked request"
                    f" ({res['parked']:,} parked in {res['park_seconds']:.1f} s)",
                    order=11,
                )
            )

    def _count_lost(self, name: str, res: dict[str, Any]) -> str:
        lost = res["n"] - res["woken_answered"]
        warm = res.get("warmup_stranded", 0)
        self.lost_wakeups.append((name, lost, res["n"], warm, res.get("warmup_n", 0)))
        if not warm:
            return ""
        return (
            f"warm-up: {warm} of {res['warmup_n']} concurrent first waiters"
            " lost their wake-up (returned only at their 15 s timeout);"
            f" {res.get('leftover_channels', 0)} channels stayed subscribed after they left"
        )

    def lost_wakeups_target(self) -> None:
        if not self.lost_wakeups:
            return
        clean = all(lost == 0 and warm == 0 for _, lost, _, warm, _ in self.lost_wakeups)
        figure = "; ".join(
            f"{name}: {lost} of {n:,} measured, {warm} of {wn} warm-up"
            for name, lost, n, warm, wn in self.lost_wakeups
        )
        self.report.target(
            "every waiter is woken by its answer, the first concurrent waiters of a fresh process too"
            " (correctness, from the issue's tests)",
            clean,
            "lost wake-ups: " + figure,
            order=2,
        )

    def _waiter_row(self, name: str, res: dict[str, Any], *, targets: bool) -> None:
        r = self.report
        wake = res["commit_to_wake_ms"]
        conns = res["redis_clients_peak"]
        per = res["rss_per_waiter_kib"]
        verdicts = []
        if targets:
            ok_n = res["woken_answered"] == res["n"]
            verdicts.append(
                "p99 <= 50 ms: "
                + r.target(
                    f"{res['n']:,} waiters, wake p99 <= 50 ms at {res['rate_target']:g} answers/s",
                    wake["p99"] <= 50 and ok_n,
                    f"p99 {wake['p99']:.1f} ms, {res['woken_answered']:,} of {res['n']:,} woken answered",
                    order=2,
                )
            )
            verdicts.append(
                "<= 2 conns: "
                + r.target(
                    "<= 2 Redis connections for waiting (pub/sub connections of the process)",
                    conns["pubsub"] <= 2,
                    f"{conns['pubsub']} pub/sub (waiters + keyspace listener); {res['redis_clients_used']}"
                    f" connections ran commands during the run, {conns['total']} open (pool)",
                    order=2,
                )
            )
            verdicts.append(
                "RSS <= 16 KiB: "
                + r.target(
                    "server RSS growth <= 16 KiB per waiter",
                    per <= 16,
                    f"{per:.1f} KiB per waiter",
                    order=2,
                )
            )
        lag = res["client_loop_lag_ms"]
        notes = [
            f"{res['woken_answered']:,}/{res['n']:,} woken with the answer",
            f"RSS {per:.1f} KiB/waiter",
            f"redis conns: {conns['pubsub']} pub/sub, {res['redis_clients_used']} used by the run,"
            f" {conns['total']} open",
            "send->wake p50 {p50:.1f} / p99 {p99:.1f} ms".format(**res["send_to_wake_ms"]),
            f"parked in {res['park_seconds']:.1f} s",
            f"client CPU {res['client_cpu_fraction']:.0%}, loop lag p99 {lag['p99']:.1f} ms",
        ]
        if res["failure_count"]:
            notes.append(f"FAILURES {res['failure_count']}: {res['failures'][0][:160]}")
        lost = self._count_lost(name, res)
        if lost:
            notes.append(lost)
        r.add(
            Row(
                name,
                res["rate_sent"],
                wake["p50"],
                wake["p99"],
                wake["max"],
                "",
                "; ".join(verdicts),
                "; ".join(notes),
                order=10,
            )
        )

    def scaleout_scenario(self) -> None:
        """Two processes on one Redis: waits parked on one are woken by answers through the other,
        and fetch driven on both at once."""
        assert self.service is not None
        assert self.redis is not None
        log("scale-out: a second service process on the same Redis")
        second = ServiceProc(self.workdir, self.redis.url, name="service-2").start()
        self.extra.append(second)
        try:
            n = 1000
            ids = self.new_ids(n + 50)
            self.settle(self.service, second, self.redis)
            job = {
                "wait_urls": [self.service.url, second.url],
                "answer_urls": [second.url, self.service.url],
                "agent_token": self.agent_token,
                "user_token": self.user_token,
                "ids": ids,
                "warmup": 50,
                "rate": self.cfg.wait_rate,
                "redis_url": self.redis.url,
                "service_pids": [self.service.pid, second.pid],
                "timeout": 600,
            }
            res = self.subprocess_json("bench.waiters", job, 300)
            self.results["scaleout_waiters"] = res
            few = asyncio.run(
                seed.create_via_http(self.service.url, self.agent_token, USER, 8, 3600, concurrency=8)
            )
            env = {"BENCH_AGENT_TOKEN": self.agent_token, "BENCH_IDS_FILE": self.ids_file("fetch-2", few)}
            outcomes: dict[str, WrkResult] = {}
            half = max(1, self.cfg.connections // 2)

            def drive(url: str) -> None:
                outcomes[url] = run_wrk(url, "fetch", seconds=self.cfg.seconds, connections=half, env=env)

            runs = [threading.Thread(target=drive, args=(u,)) for u in (self.service.url, second.url)]
            for t in runs:
                t.start()
            for t in runs:
                t.join()
            total = sum(o.rps for o in outcomes.values())
        finally:
            second.stop()
        lost = self._count_lost("scale-out", res)
        ok = res["woken_answered"] == res["n"] and not res["failure_count"] and not lost
        met = self.report.target(
            "two processes on one Redis both serve waits and answers correctly",
            ok,
            f"{res['woken_answered']:,} of {res['n']:,} waiters woken across processes",
            order=4,
        )
        single = self.results.get("median_rps", {}).get("fetch")
        base = statistics.median(self.baseline_rps) if self.baseline_rps else None
        self.report.add(
            Row(
                "scale-out: wait across 2 processes",
                res["rate_sent"],
                res["commit_to_wake_ms"]["p50"],
                res["commit_to_wake_ms"]["p99"],
                res["commit_to_wake_ms"]["max"],
                "",
                f"correct: {met}",
                f"{n:,} waiters, half on each process, each answered through the other;"
                f" redis conns for both: {res['redis_clients_peak']['pubsub']} pub/sub,"
                f" {res['redis_clients_used']} used by the run, {res['redis_clients_peak']['total']} open"
                + (f"; {lost}" if lost else ""),
                order=20,
            )
        )
        self.report.add(
            Row(
                "scale-out: fetch on 2 processes",
                total,
                max(o.p50_ms for o in outcomes.values()),
                max(o.p99_ms for o in outcomes.values()),
                max(o.max_ms for o in outcomes.values()),
                f"{total / base:.2f}" if base else "",
                "",
                f"two wrk -c{half} at once;"
                + (f" x{total / single:.2f} of one process" if single else "")
                + " (2 cores shared by both processes, Redis and wrk)",
                order=21,
            )
        )

    def peer_scenario(self) -> None:
        assert self.service is not None
        cfg = self.cfg
        log(f"peer: ask+wait with {cfg.peer_concurrency} concurrent callers, ours then DBOS")
        job: dict[str, Any] = {
            "service_url": self.service.url,
            "agent_token": self.agent_token,
            "user_token": self.user_token,
            "user": USER,
            "concurrency": cfg.peer_concurrency,
            "seconds": cfg.peer_seconds,
        }
        self.settle(self.service, self.redis)
        ours = self.subprocess_json("bench.dbos_peer", job, 600)["ours"]
        dbos: dict[str, Any]
        if "dbos" in cfg.skip:
            dbos = {"error": "skipped (BENCH_SKIP=dbos)"}
        elif not _importable("dbos"):
            dbos = {"error": "dbos is not installed: `make bench` installs it with pip (.[bench])"}
        else:
            dbos_job = {
                "pg_url": cfg.pg_url,
                "concurrency": cfg.peer_concurrency,
                "seconds": cfg.peer_seconds,
            }
            try:
                dbos = self.subprocess_json("bench.dbos_peer", dbos_job, 600)["dbos"]
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                dbos = {"error": str(exc)[-500:]}
        self.results["peer"] = {"ours": ours, "dbos": dbos}
        c = cfg.peer_concurrency
        self.report.add(
            Row(
                f"ask+wait, {c} callers: ours",
                ours["asks_per_second"],
                ours["wake_ms"]["p50"],
                ours["wake_ms"]["p99"],
                ours["wake_ms"]["max"],
                "",
                "",
                "; ".join(
                    [
                        f"requests/s = asks/s; answers/s {ours['answers_per_second']:,.0f}",
                        "latencies = wake (answer sent -> waiter has it) in the ask/answer/wait loop"
                        f" ({ours['cycles_per_second']:,.0f} loops/s)",
                        "backlog wake p50 {p50:.1f} / p99 {p99:.1f} ms".format(
                            **ours["answers_phase_wake_ms"]
                        )
                        + f" ({ours['asks']:,} waiting while answered at full speed)",
                        *([f"FAILURES: {ours['failures'][0]}"] if ours["failures"] else []),
                    ]
                ),
                order=30,
            )
        )
        if "error" in dbos:
            self.report.add(
                Row(f"ask+wait, {c} callers: DBOS", notes=f"not run: {dbos['error'][:300]}", order=31)
            )
            self.report.notes.append(f"DBOS peer not run: {dbos['error']}")
            return
        asks = ours["asks_per_second"] / dbos["asks_per_second"]
        answers = ours["answers_per_second"] / dbos["answers_per_second"]
        p50 = dbos["wake_ms"]["p50"] / ours["wake_ms"]["p50"]
        p99 = dbos["wake_ms"]["p99"] / ours["wake_ms"]["p99"]
        self.report.add(
            Row(
                f"ask+wait, {c} callers: DBOS {dbos.get('version', '')}",
                dbos["asks_per_second"],
                dbos["wake_ms"]["p50"],
                dbos["wake_ms"]["p99"],
                dbos["wake_ms"]["max"],
                "",
                "",
                "; ".join(
                    [
                        f"ours/DBOS: asks/s x{asks:.1f}, answers/s x{answers:.1f},"
                        f" wake p50 {p50:.0f}x and p99 {p99:.0f}x shorter",
                        f"DBOS answers/s {dbos['answers_per_second']:,.0f}",
                        "recv-side wake p50 {p50:.0f} / p99 {p99:.0f} ms".format(**dbos["recv_wake_ms"]),
                        "backlog wake p50 {p50:.0f} / p99 {p99:.0f} ms".format(
                            **dbos["answers_phase_recv_wake_ms"]
                        )
                        + f" ({dbos['asks']:,} waiting)",
                        f"PostgreSQL, fresh database {dbos['database']} (dropped)",
                    ]
                ),
                order=31,
            )
        )

    def sweeper_scenario(self) -> None:
        from bench.sweeper import run_sweeper

        n = self.cfg.sweep
        log(f"sweeper: {n:,} overdue questions on a fresh redis-server, no service running")
        redis = RedisProc(self.workdir).start()
        try:
            res = run_sweeper(redis.url, n)
        finally:
            redis.stop()
        self.results["sweeper"] = res
        met_time = self.report.target(
            f"sweeper expires {n:,} overdue questions in <= 5 s",
            res["seconds"] <= 5,
            f"{res['seconds']:.2f} s",
            order=3,
        )
        met_once = self.report.target(
            "each overdue question expired exactly once",
            res["exactly_once"],
            f"{res['expired']:,} by the pass, {res['second_pass_expired']} by a second;"
            f" stats {res['stats_expired']:,}; outbox {res['expired_events']:,} events"
            f" for {res['distinct_expired_events']:,} ids",
            order=3,
        )
        self.report.add(
            Row(
                f"sweeper, {n:,} overdue",
                res["per_second"],
                target=f"<= 5 s: {met_time}; exactly once: {met_once}",
                notes=f"one sweep_once took {res['seconds']:.2f} s"
                f" (sweeper CPU {res['sweeper_cpu_seconds']:.1f} s,"
                f" redis CPU {res['redis_cpu_seconds']:.1f} s); requests/s = questions expired per second",
                order=40,
            )
        )

    def add_ladder_rows(self, scenarios: dict[str, Scenario]) -> None:
        """Where a fetch's time goes: bench/ladder.py's rungs, then the service's fetch."""
        steps = (
            ("ladder: bare + the store's read (one coalesced EVALSHA)", "ladder-script", None),
            ("ladder: + the envelope, answered as fetch is", "ladder-read", "ladder-script"),
            ("ladder: + middlewares, auth, metrics (= fetch)", "fetch", "ladder-read"),
        )
        for name, run, before in steps:
            sc = scenarios[run]
            cpu_us = statistics.median(
                c * 1e6 / max(res.rps, 1) for c, res in zip(sc.cpu, sc.runs, strict=True)
            )
            note = f"ratio per round {sc.ratio_list()}; {cpu_us:.0f} µs of process CPU per request"
            if before is not None:
                note += f"; x{sc.median('rps') / scenarios[before].median('rps'):.2f} of the rung before"
            self.report.add(sc.row(name, "", note, order=1))

    def stop(self) -> None:
        for proc in (*self.extra, self.service, self.baseline, self.redis):
            if proc is not None:
                try:
                    proc.stop()
                except Exception as exc:
                    log(f"stopping {proc.name}: {exc}")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main() -> int:
    cfg = Config()
    raise_fd_limit()
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="qs-bench-"))
    bench = Bench(cfg, workdir)
    steps = [
        # Waiters first: RSS per waiter is measured on processes whose heap is still fresh.
        ("waiters", bench.waiter_scenarios),
        ("wrk", bench.http_scenarios),
        ("scaleout", bench.scaleout_scenario),
        ("peer", bench.peer_scenario),
    ]
    try:
        bench.start()
        for name, step in steps:
            if name in cfg.skip:
                continue
            try:
                step()
            except Exception as exc:
                log(f"{name} failed: {exc!r}")
                traceback.print_exc()
                bench.report.notes.append(f"scenario {name} failed: {exc!r}"[:500])
        bench.lost_wakeups_target()
        for proc in (bench.service, bench.baseline):
            if proc is not None:
                proc.stop()
        if "sweeper" not in cfg.skip and cfg.sweep > 0:
            try:
                bench.sweeper_scenario()
            except Exception as exc:
                log(f"sweeper failed: {exc!r}")
                traceback.print_exc()
                bench.report.notes.append(f"scenario sweeper failed: {exc!r}"[:500])
    finally:
        bench.stop()
        keep = os.environ.get("BENCH_KEEP_LOGS", "") in ("1", "true", "yes")
        if keep:
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    report = bench.report
    report.notes.append(
        f"whole run {time.perf_counter() - started:.0f} s; load average at the end"
        f" {' / '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(bench.results, indent=2, default=str))
    print()
    print(text_table(report))
    print()
    for t in report.targets:
        print(f"target: {t.text}: {t.figure} -> {'met' if t.met else 'NOT met'}")
    for note in report.notes:
        print(f"note: {note}")
    if cfg.write_doc:
        write_doc(report)
        print(f"\nwrote {Path('docs/benchmarks.md')} (raw figures: bench/results/latest.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
