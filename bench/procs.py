"""The processes a bench run owns: its own redis-server, service and baseline app, on free ports.

Everything started here is stopped here (by its own pid), so a run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "bench-admin-token-" + os.urandom(8).hex()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_fd_limit(want: int = 65536) -> int:
    """Raise the soft open-files limit as far as the hard limit allows; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def status_kib(pid: int, field: str = "VmRSS") -> int:
    """A field of /proc/<pid>/status in KiB (VmRSS: resident memory)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (from /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(parts[11]) + int(parts[12])) / ticks


class Proc:
    """A child process with a log file, stopped by its own pid."""

    def __init__(self, name: str, args: list[str], env: Mapping[str, str] | None, logdir: Path) -> None:
        self.name = name
        self.args = args
        self.env = dict(os.environ if env is None else env)
        self.log_path = logdir / f"{name}.log"
        self.cwd = ROOT  # `python -m` imports from here first (bench.ab runs an older tree this way)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
        self.process = subprocess.Popen(
            self.args, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT if self.name != "redis" else signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        self.process = None


def wait_http(url: str, proc: Proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited during start:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not answer {url} within {timeout:g} s:\n{proc.log_tail()}")


class RedisProc(Proc):
    """A throwaway redis-server: its own port and temp dir, no persistence."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="redis-", dir=workdir))
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "no", "--maxclients", "20000",
            "--maxmemory-policy", "noeviction", *extra,
        ]  # fmt: skip
        super().__init__("redis", args, None, workdir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProc:
        super().start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"redis-server exited:\n{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not become ready")


class ServiceProc(Proc):
    """`python -m service serve` on a free port against the bench's Redis."""

    def __init__(
        self,
        workdir: Path,
        redis_url: str,
        name: str = "service",
        *,
        command_prefix: Sequence[str] = (),
        **settings: str,
    ) -> None:
        """`command_prefix`: run the service under another program that execs it (e.g. `env
        LD_PRELOAD=... FAKETIME=+1h`); not one that forks, as stop() signals this pid only."""
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            {
                "QS_REDIS_URL": redis_url,
                "QS_PORT": str(self.port),
                "QS_HOST": "127.0.0.1",
                "QS_ADMIN_TOKEN": ADMIN_TOKEN,
                "QS_LOG_LEVEL": "WARNING",
                # Long enough that no parked waiter of the bench times out while it waits its turn.
                "QS_WAIT_MAX_SECONDS": "600",
                "QS_WAIT_DEFAULT_SECONDS": "60",
                # The 10,000 waiters and the warm-up ones are one agent's: more than the default.
                "QS_WAITS_PER_PRINCIPAL": "20000",
            }
        )
        # BENCH_SERVICE_ENV="QS_X=1,QS_Y=2" runs the bench's services with other settings.
        for pair in os.environ.get("BENCH_SERVICE_ENV", "").split(","):
            variable, sep, value = pair.strip().partition("=")
            if sep and variable.startswith("QS_"):
                env[variable] = value
        env.update({f"QS_{k.upper()}": v for k, v in settings.items()})
        super().__init__(name, [*command_prefix, sys.executable, "-m", "service", "serve"], env, workdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServiceProc:
        super().start()
        wait_http(self.url + "/healthz", self)
        return self


class AppProc(Proc):
    """One of the bench's own aiohttp apps (`python -m <module> --port P ...`), ready once `/`
    answers."""

    def __init__(self, name: str, module: str, workdir: Path, *extra: str) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", module, "--port", str(self.port), *extra]
        super().__init__(name, args, None, workdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        super().start()
        wait_http(self.url + "/", self)
        return self


class BaselineProc(AppProc):
    """bench/baseline.py: the bare aiohttp app every ratio is taken against."""

    def __init__(self, workdir: Path) -> None:
        super().__init__("baseline", "bench.baseline", workdir)


class LadderProc(AppProc):
    """bench/ladder.py: the rungs between the bare baseline and the service's fetch."""

    def __init__(self, workdir: Path, redis_url: str) -> None:
        super().__init__("ladder", "bench.ladder", workdir, "--redis", redis_url)


def service_redis_ports(service_pid: int, redis_port: int) -> set[int]:
    """Local ports of the service's TCP connections to Redis (from /proc/<pid>/fd and /proc/net/tcp),
    so CLIENT LIST entries can be attributed to that process by their addr."""
    inodes = set()
    fd_dir = f"/proc/{service_pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    remote_port = f":{redis_port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for line in f:
                if remote_port not in line:
                    continue
                cols = line.split()
                local, remote, inode = cols[1], cols[2], cols[9]
                if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == redis_port:
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def count_service_clients(client_list: list[dict[str, object]], ports: set[int]) -> tuple[int, int]:
    """(all connections, pub/sub connections) of CLIENT LIST that belong to those local ports."""
    total = pubsub = 0
    for client in client_list:
        addr = str(client.get("addr", ""))
        try:
            port = int(addr.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
        if port not in ports:
            continue
        total += 1
        flags = str(client.get("flags", ""))
        subs = int(str(client.get("sub", 0)) or 0) + int(str(client.get("psub", 0)) or 0)
        if "P" in flags or subs > 0 or str(client.get("cmd", "")) in ("subscribe", "unsubscribe"):
            pubsub += 1
    return total, pubsub
