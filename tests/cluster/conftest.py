"""The cluster tier: one real Redis Cluster (3 primaries, 3 replicas) for the whole session.

Every test uses its own key prefix (tests.conftest.test_settings), so tests share the cluster
without seeing each other's keys. A test that fails a primary over leaves the cluster healthy
(with other nodes as primaries), which is all the other tests rely on.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp.test_utils import TestClient

from service.settings import Settings
from tests.api import Api
from tests.cluster.cluster_server import ClusterServer
from tests.conftest import ADMIN_TOKEN, close_client, start_client, test_settings


@pytest.fixture(scope="session")
def cluster_server() -> Iterator[ClusterServer]:
    cluster = ClusterServer(primaries=3, replicas=1).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def cluster_settings(cluster_server: ClusterServer) -> Settings:
    return test_settings(cluster_server.url)


@pytest.fixture
async def cluster_client(cluster_settings: Settings) -> AsyncIterator[TestClient[object, object]]:
    client = await start_client(cluster_settings)
    yield client
    await close_client(client)


@pytest.fixture
async def cluster_api(cluster_client: TestClient[object, object]) -> Api:
    return Api(cluster_client, ADMIN_TOKEN)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """redis-py 8.1's cluster client drops ClusterNode objects and sockets of nodes a failover
    or a topology refresh replaced without closing them (ResourceWarning at garbage collection,
    in redis-py, not in the service). The tier runs in its own pytest process (Makefile) and lets
    only those warnings through; every assertion on stories, counters and wake-ups still holds."""
    for item in items:
        if "tests/cluster/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::ResourceWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"))


@pytest.fixture(autouse=True)
def collect_what_the_cluster_client_dropped() -> Iterator[None]:
    """Collect the objects redis-py's cluster client dropped (above) while the test's own warning
    filters still apply: left to the end of the session, their warnings failed the whole run."""
    yield
    gc.collect()
