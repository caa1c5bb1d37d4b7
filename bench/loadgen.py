"""wrk as the one load generator for the HTTP scenarios: run it with a script of bench/wrk/ and
read the JSON line its `done` hook prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "wrk"
MARK = "BENCH_JSON "


@dataclass
class WrkResult:
    rps: float
    requests: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int]
    non_2xx: int = 0
    raw: str = field(default="", repr=False)

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())


def wrk_binary() -> str:
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install wrk)")
    return binary


def run_wrk(
    url: str,
    script: str,
    *,
    seconds: float,
    connections: int,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 10.0,
) -> WrkResult:
    """`wrk -t<threads> -c<connections> -d<seconds>s --latency -s bench/wrk/<script>.lua <url>`."""
    args = [
        wrk_binary(), f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
        "--latency", f"--timeout={timeout_s:g}s", "-s", str(SCRIPTS / f"{script}.lua"), url,
    ]  # fmt: skip
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["BENCH_WRK_THREADS"] = str(threads)
    full_env["LUA_PATH"] = f"{SCRIPTS}/?.lua;;"
    done = subprocess.run(
        args, env=full_env, cwd=SCRIPTS, capture_output=True, text=True, timeout=seconds + 60
    )
    out = done.stdout + done.stderr
    line = next((ln for ln in out.splitlines() if ln.startswith(MARK)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {done.returncode}):\n{out[-3000:]}")
    data = json.loads(line[len(MARK) :])
    non_2xx = 0
    for ln in out.splitlines():
        if "Non-2xx or 3xx responses:" in ln:
            non_2xx = int(ln.rsplit(":", 1)[1])
    return WrkResult(
        rps=data["rps"],
        requests=data["requests"],
        seconds=data["seconds"],
        p50_ms=data["p50_us"] / 1000,
        p90_ms=data["p90_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        max_ms=data["max_us"] / 1000,
        errors=data["errors"],
        non_2xx=non_2xx,
        raw=out,
    )
