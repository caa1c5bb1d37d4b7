"""`stats` and the Redis settings checks of /readyz read every primary of a cluster, not the one
node redis-py sends INFO and CONFIG to by default: a risky setting on any primary is reported,
naming that primary, and memory and clients are per primary and summed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient

from service import stats
from service.http.appkeys import REDIS, SETTINGS
from tests.api import Api
from tests.cluster.cluster_server import ClusterServer, command
from tests.conftest import ADMIN_TOKEN


@pytest.fixture
def one_primary_evicts(cluster_server: ClusterServer) -> Iterator[int]:
    """One primary set to evict keys (allkeys-lru) for the test, then set back."""
    port = max(cluster_server.primary_ports())
    before = command(port, "config", "get", "maxmemory-policy").splitlines()[1]
    command(port, "config", "set", "maxmemory-policy", "allkeys-lru")
    yield port
    command(port, "config", "set", "maxmemory-policy", before)


async def test_readyz_reports_a_risky_setting_on_any_primary_and_names_that_primary(
    cluster_client: TestClient[object, object], cluster_server: ClusterServer, one_primary_evicts: int
) -> None:
    reply = await Api(cluster_client, ADMIN_TOKEN).call("GET", "/readyz")

    assert reply.status == 200
    check = reply.body["checks"]["maxmemory_policy"]
    assert check["state"] == "at_risk"
    assert (
        f"1 of {len(cluster_server.primary_ports())} primaries: 127.0.0.1:{one_primary_evicts}"
        in check["detail"]
    )
    assert any(w.startswith("maxmemory_policy: ") for w in reply.body["warnings"])


async def test_settings_checks_are_ok_when_every_primary_is_safe(
    cluster_client: TestClient[object, object], cluster_server: ClusterServer
) -> None:
    checks = await stats.redis_checks(cluster_client.server.app[REDIS], cluster_client.server.app[SETTINGS])

    policy = next(c for c in checks if c.name == "maxmemory_policy")
    assert policy.state is stats.CheckState.OK
    assert (
        f"every primary: {', '.join(sorted(f'127.0.0.1:{p}' for p in cluster_server.primary_ports()))}"
        in (policy.detail)
    )


async def test_stats_sums_memory_and_clients_over_every_primary_and_lists_each(
    cluster_client: TestClient[object, object], cluster_server: ClusterServer
) -> None:
    app = cluster_client.server.app
    figures = await stats.collect(app[REDIS], app[SETTINGS])

    nodes = figures["nodes"]
    assert sorted(nodes) == sorted(f"127.0.0.1:{p}" for p in cluster_server.primary_ports())
    for port in cluster_server.primary_ports():
        node = nodes[f"127.0.0.1:{port}"]
        assert node["used_memory"] > 0
        assert node["connected_clients"] >= 1
        assert node["maxmemory_policy"] == command(port, "config", "get", "maxmemory-policy").splitlines()[1]
    assert figures["memory"]["used_memory"] == sum(n["used_memory"] for n in nodes.values())
    assert figures["connected_clients"] == sum(n["connected_clients"] for n in nodes.values())
    text = stats.render_text(figures)
    assert all(f"primary 127.0.0.1:{port}" in text for port in cluster_server.primary_ports())
