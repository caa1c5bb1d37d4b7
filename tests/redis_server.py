"""Start and stop real redis-server processes on free ports, in temporary folders.

Tests never touch the machine's own Redis on 6379: fault tests kill and restart these.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

BINARY = shutil.which("redis-server")
MISSING = "redis-server is not installed (Debian: apt-get install redis-server)"


def require_tool(found: str | None, missing: str) -> str:
    """`found` (a tool the tests need); without it, a skip with the reason, or a failure under
    CI=true, where .ci/run installs every such tool."""
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail(missing + " -- required under CI=true")
        pytest.skip(reason=missing)
    return found


def require_binary() -> str:
    """The redis-server path."""
    return require_tool(BINARY, MISSING)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, *extra: str, port: int | None = None) -> None:
        self.binary = require_binary()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="qs-redis-"))
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--save", "", "--appendonly", "no", "--logfile", str(self.dir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited: {log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.port} did not become ready")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
        self.process = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
