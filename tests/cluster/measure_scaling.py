"""Throughput of the scripts on one Redis vs a 3-primary Redis Cluster (a small measurement for
docs/scaling.md, not a test): `python -m tests.cluster.measure_scaling [seconds]`.

Two driver processes, each with 64 concurrent loops of create -> answer -> fetch through the
service's QuestionStore (coalesced EVALSHA pipelines, as in the service), against (a) one
redis-server and (b) a cluster of three primaries without replicas, each started here on free
ports and removed afterwards. It prints calls/s and each Redis process' CPU seconds per 1,000
calls. Caveat: on a 2-core machine the drivers and every redis-server share the same two cores.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time
import uuid

from service.keys import BUCKETS
from service.redis_client import connect
from service.scripts import Scripts
from service.settings import Settings
from service.store import QuestionStore, new_call_id
from tests.cluster.cluster_server import ClusterServer, command
from tests.helpers_reliability import new_question
from tests.redis_server import RedisServer

LOOPS = 64
DRIVERS = 2


async def drive(url: str, prefix: str, seconds: float) -> int:
    settings = Settings(redis_url=url, key_prefix=prefix, redis_max_connections=128)
    redis = connect(settings)
    scripts = Scripts(redis)
    await scripts.load_all()
    store = QuestionStore(redis, scripts, settings)
    stop = time.monotonic() + seconds
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < stop:
            created = await store.create(new_question(), None)
            assert created.fields is not None
            question_id = created.fields["id"]
            await store.answer(question_id, "alice", "yes", [], new_call_id())
            await store.read(question_id)
            done += 3

    await asyncio.gather(*(loop() for _ in range(LOOPS)))
    await scripts.aclose()
    await redis.aclose()
    return done


def driver(url: str, prefix: str, seconds: float, results: multiprocessing.Queue[int]) -> None:
    results.put(asyncio.run(drive(url, prefix, seconds)))


def cpu_seconds(ports: list[int]) -> float:
    total = 0.0
    for port in ports:
        info = command(port, "info", "cpu")
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        total += float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])
    return total


def measure(url: str, ports: list[int], seconds: float) -> tuple[float, float]:
    results: multiprocessing.Queue[int] = multiprocessing.Queue()
    prefix = f"m{uuid.uuid4().hex[:8]}"
    before = cpu_seconds(ports)
    processes = [
        multiprocessing.Process(target=driver, args=(url, prefix, seconds, results)) for _ in range(DRIVERS)
    ]
    started = time.monotonic()
    for p in processes:
        p.start()
    calls = sum(results.get() for _ in processes)
    for p in processes:
        p.join()
    elapsed = time.monotonic() - started
    return calls / elapsed, (cpu_seconds(ports) - before) / calls * 1000


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    single = RedisServer().start()
    try:
        rate, cpu = measure(single.url, [single.port], seconds)
        print(f"1 primary:  {rate:8.0f} calls/s, Redis CPU {cpu:.3f} s per 1,000 calls")
    finally:
        single.cleanup()
    cluster = ClusterServer(primaries=3, replicas=0).start()
    try:
        rate, cpu = measure(cluster.url, cluster.ports, seconds)
        print(f"3 primaries: {rate:8.0f} calls/s, Redis CPU {cpu:.3f} s per 1,000 calls (all nodes)")
    finally:
        cluster.cleanup()
    print(
        f"({DRIVERS} driver processes x {LOOPS} loops of create/answer/fetch, {seconds:.0f} s, "
        f"{BUCKETS} buckets)"
    )


if __name__ == "__main__":
    main()
