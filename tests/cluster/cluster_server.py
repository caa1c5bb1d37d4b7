"""A real Redis Cluster for tests: N primaries (and as many replicas) from redis-server binaries,
on free ports in temporary folders, joined with `redis-cli --cluster create`."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

from tests.redis_server import RedisServer, require_binary, require_tool

CLI = shutil.which("redis-cli")
MISSING_CLI = "redis-cli is not installed (Debian: apt-get install redis-tools)"
NODE_TIMEOUT_MS = 1000


def require_cli() -> str:
    return require_tool(CLI, MISSING_CLI)


def command(port: int, *args: str, timeout: float = 10.0) -> str:
    """One redis-cli command against a node; its reply as text."""
    done = subprocess.run(
        [require_cli(), "-p", str(port), *args], capture_output=True, text=True, timeout=timeout, check=True
    )
    return done.stdout.strip()


class ClusterServer:
    """`primaries` primaries with `replicas` replicas each, all on 127.0.0.1."""

    def __init__(self, primaries: int = 3, replicas: int = 1) -> None:
        require_binary()
        require_cli()
        self.primaries = primaries
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--notify-keyspace-events",
                "Ex",
                port=cluster_port(),
            )
            for _ in range(primaries * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def start(self) -> ClusterServer:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [require_cli(), "--cluster", "create", *addresses,
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every node says cluster_state:ok and agrees on `primaries` primaries with all slots."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._healthy(port) for port in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not become healthy")

    def _healthy(self, port: int) -> bool:
        try:
            info = command(port, "cluster", "info")
            nodes = command(port, "cluster", "nodes")
        except (subprocess.SubprocessError, OSError):
            return False
        masters = [line for line in nodes.splitlines() if "master" in line.split()[2] and "fail" not in line]
        replicas_linked = all(
            "connected" in line for line in nodes.splitlines() if "slave" in line.split()[2]
        )
        return "cluster_state:ok" in info and len(masters) == self.primaries and replicas_linked

    def roles(self) -> dict[int, str]:
        """Port -> 'master' or 'slave', as each node says of itself."""
        found = {}
        for port in self.ports:
            found[port] = command(port, "role").splitlines()[0]
        return found

    def primary_ports(self) -> list[int]:
        return [p for p, role in self.roles().items() if role == "master"]

    def replica_of(self, primary_port: int) -> int:
        """A replica port of the given primary."""
        for port, role in self.roles().items():
            if role == "slave" and command(port, "role").splitlines()[2] == str(primary_port):
                return port
        raise LookupError(f"no replica of {primary_port}")

    def failover(self, replica_port: int, timeout: float = 20.0) -> None:
        """A graceful `CLUSTER FAILOVER` on a replica; returns once it is a primary and all agree."""
        command(replica_port, "cluster", "failover")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if command(replica_port, "role").splitlines()[0] == "master":
                self.wait_healthy(timeout)
                return
            time.sleep(0.05)
        raise RuntimeError(f"replica {replica_port} did not take over")

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis refuses ports above 55535."""
    for _ in range(200):
        port = random.randrange(20000, 55535)
        if port not in _taken and _bindable(port) and _bindable(port + 10000):
            _taken.add(port)
            return port
    raise RuntimeError("no free port pair for a cluster node")


_taken: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
