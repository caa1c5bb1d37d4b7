"""The peer: the same ask-then-wait-for-a-human scenario on DBOS (durable workflows on
PostgreSQL) and on our service, with the same number of concurrent callers.

DBOS: an ask is `DBOS.start_workflow(ask_human, ...)`, a workflow that waits with
`DBOS.recv("answer", timeout_seconds=...)`; an answer is `DBOS.send(workflow_id, ..., "answer")`;
the asker waits on the workflow handle's `get_result()`. It runs on a fresh database made for
the run and dropped after it.

Ours: an ask is POST /v1/questions, an answer POST /v1/questions/{id}/answer, the asker waits
with GET /v1/questions/{id}/wait.

Three phases per system, each with C concurrent callers (default 16) for S seconds:
  asks     C callers ask as fast as they can; each ask leaves a waiter   -> asks/s
           (DBOS: the workflow in recv; ours: the asker's long-poll)
  answers  C callers answer the questions the asks phase left waiting    -> answers/s, and
           the wake latency of that backlog of waiters
  cycle    C callers each loop: ask, start waiting, answer after a short
           think time, receive the result                                -> wake latency
Wake latency is measured from the moment the answer call starts (both systems commit inside
it) to the moment the waiting caller holds the result; for DBOS also to the moment `recv`
returned inside the workflow (its own wake-up, before the result travels back).

    python -m bench.dbos_peer  (JSON job on stdin, JSON result on stdout)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.waiters import parse_rfc3339, summary_ms

THINK_SECONDS = 0.02
RECV_TIMEOUT = 120.0


# -- DBOS -----------------------------------------------------------------------------------------


def run_dbos(pg_admin_url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    try:
        import psycopg
        from dbos import DBOS
    except ImportError as exc:
        return {"error": f"dbos is not installed ({exc}); run `pip install -e '.[bench]'`"}

    database = "qs_bench_dbos_" + uuid.uuid4().hex[:8]
    try:
        with psycopg.connect(pg_admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
    except Exception as exc:
        return {"error": f"cannot create a database at {pg_admin_url}: {exc}"}
    url = pg_admin_url.rsplit("/", 1)[0] + "/" + database
    try:
        return _dbos_phases(DBOS, url, database, concurrency, seconds)
    except Exception as exc:
        return {"error": f"DBOS run failed: {exc!r}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        with contextlib.suppress(Exception):
            DBOS.destroy(destroy_registry=True)
        try:
            with psycopg.connect(pg_admin_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        except Exception as exc:
            print(f"could not drop database {database}: {exc}", file=sys.stderr)


def _dbos_phases(DBOS: Any, url: str, database: str, concurrency: int, seconds: float) -> dict[str, Any]:
    @DBOS.workflow()
    def ask_human(prompt: str, timeout: float) -> dict[str, Any]:
        answer = DBOS.recv("answer", timeout_seconds=timeout)
        return {"answer": answer, "woke_at": time.time()}

    DBOS(config={"name": "qs-bench-peer", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()
    try:
        import dbos

        version = getattr(dbos, "__version__", "")
    except Exception:
        version = ""
    if not version:
        from importlib.metadata import version as dist_version

        version = dist_version("dbos")

    lock = threading.Lock()

    # asks: nobody answers yet.
    handles: list[Any] = []

    def asker(deadline: float) -> None:
        while time.perf_counter() < deadline:
            handle = DBOS.start_workflow(ask_human, "Deploy build 4711?", RECV_TIMEOUT)
            with lock:
                handles.append(handle)

    asks_seconds = _threads(concurrency, asker, seconds)
    asks = len(handles)

    # answers: to the workflows the asks phase left waiting, C at a time.
    todo = list(handles)
    answered = [0]
    sent_at: dict[str, float] = {}

    def answerer(deadline: float) -> None:
        while time.perf_counter() < deadline:
            with lock:
                if not todo:
                    return
                handle = todo.pop()
            sent_at[handle.workflow_id] = time.time()
            DBOS.send(handle.workflow_id, "yes", "answer")
            with lock:
                answered[0] += 1

    answers_seconds = _threads(concurrency, answerer, seconds)
    answers = answered[0]
    for handle in todo:  # not timed: let every workflow of the asks phase finish
        DBOS.send(handle.workflow_id, "yes", "answer")
    drain_started = time.perf_counter()
    backlog_wake = []
    for handle in handles:
        result = handle.get_result()
        if handle.workflow_id in sent_at:
            backlog_wake.append(result["woke_at"] - sent_at[handle.workflow_id])
    drain_seconds = time.perf_counter() - drain_started

    # cycle: ask, wait, answer, receive, C callers at once.
    recv_wake: list[float] = []
    result_wake: list[float] = []
    cycles = [0]

    def caller(deadline: float) -> None:
        while time.perf_counter() < deadline:
            handle = DBOS.start_workflow(ask_human, "Deploy build 4711?", RECV_TIMEOUT)
            time.sleep(THINK_SECONDS)
            sent = time.time()
            DBOS.send(handle.workflow_id, "yes", "answer")
            result = handle.get_result()
            received = time.time()
            with lock:
                recv_wake.append(result["woke_at"] - sent)
                result_wake.append(received - sent)
                cycles[0] += 1

    cycle_seconds = _threads(concurrency, caller, seconds)
    return {
        "version": version,
        "database": database,
        "concurrency": concurrency,
        "asks": asks,
        "asks_per_second": asks / asks_seconds,
        "answers": answers,
        "answers_per_second": answers / answers_seconds,
        "answers_phase_recv_wake_ms": summary_ms(backlog_wake),
        "drain_seconds": drain_seconds,
        "cycles": cycles[0],
        "cycles_per_second": cycles[0] / cycle_seconds,
        "wake_ms": summary_ms(result_wake),
        "recv_wake_ms": summary_ms(recv_wake),
    }


def _threads(count: int, target: Any, seconds: float) -> float:
    started = time.perf_counter()
    deadline = started + seconds
    with ThreadPoolExecutor(count) as pool:
        for future in [pool.submit(target, deadline) for _ in range(count)]:
            future.result()
    return time.perf_counter() - started


# -- ours -----------------------------------------------------------------------------------------


async def run_ours(job: dict[str, Any], concurrency: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    url = job["service_url"]
    agent = {"Authorization": f"Bearer {job['agent_token']}"}
    user = {"Authorization": f"Bearer {job['user_token']}"}
    body = {
        "prompt": "Deploy build 4711?",
        "options": [{"id": "yes", "label": "Yes"}, {"id": "no", "label": "No"}],
        "to": {"user": job["user"]},
        "expires_in": 3600,
    }
    timeout = aiohttp.ClientTimeout(total=RECV_TIMEOUT + 30)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
    failures: list[str] = []

    async def ask() -> str:
        async with http.post(f"{url}/v1/questions", json=body, headers=agent) as reply:
            if reply.status != 201:
                raise RuntimeError(f"ask: {reply.status} {await reply.text()}")
            return str((await reply.json())["id"])

    async def answer(question_id: str) -> dict[str, Any]:
        async with http.post(
            f"{url}/v1/questions/{question_id}/answer", json={"option": "yes"}, headers=user
        ) as reply:
            if reply.status != 200:
                raise RuntimeError(f"answer: {reply.status} {await reply.text()}")
            result: dict[str, Any] = await reply.json()
            return result

    async def wait(question_id: str) -> dict[str, Any]:
        async with http.get(
            f"{url}/v1/questions/{question_id}/wait?timeout={RECV_TIMEOUT:g}", headers=agent
        ) as reply:
            if reply.status != 200:
                raise RuntimeError(f"wait: {reply.status} {await reply.text()}")
            result: dict[str, Any] = await reply.json()
            return result

    async def workers(target: Any) -> float:
        started = time.perf_counter()
        deadline = started + seconds
        await asyncio.gather(*(target(deadline) for _ in range(concurrency)))
        return time.perf_counter() - started

    try:
        # asks: each ask is followed by its asker's long-poll, as an agent does; nobody answers.
        asked: list[str] = []
        waits: dict[str, asyncio.Task[tuple[dict[str, Any], float]]] = {}

        async def timed_wait(question_id: str) -> tuple[dict[str, Any], float]:
            envelope = await wait(question_id)
            return envelope, time.time()

        async def asker(deadline: float) -> None:
            while time.perf_counter() < deadline:
                question_id = await ask()
                asked.append(question_id)
                waits[question_id] = asyncio.create_task(timed_wait(question_id))

        asks_seconds = await workers(asker)
        await asyncio.sleep(1.0)  # let the last long-polls park
        # answers: to the questions the asks phase left waiting, C at a time.
        todo = list(asked)
        sent_at: dict[str, float] = {}

        async def answerer(deadline: float) -> None:
            while todo and time.perf_counter() < deadline:
                question_id = todo.pop()
                sent_at[question_id] = time.time()
                await answer(question_id)

        answers_seconds = await workers(answerer)
        answered = [len(sent_at)]
        await asyncio.gather(*(answer(q) for q in todo))  # not timed: release every waiter
        backlog_wake = []
        for question_id, task in waits.items():
            envelope, received = await task
            if envelope["state"] != "answered":
                failures.append(f"woken with state {envelope['state']}")
            elif question_id in sent_at:
                backlog_wake.append(received - sent_at[question_id])

        wake: list[float] = []
        commit_wake: list[float] = []
        cycles = [0]

        async def caller(deadline: float) -> None:
            while time.perf_counter() < deadline:
                question_id = await ask()
                waiting = asyncio.create_task(wait(question_id))
                await asyncio.sleep(THINK_SECONDS)
                sent = time.time()
                reply = await answer(question_id)
                envelope = await waiting
                received = time.time()
                if envelope["state"] != "answered":
                    failures.append(f"woken with state {envelope['state']}")
                wake.append(received - sent)
                answered_at = reply["question"]["answer"]["answered_at"]
                commit_wake.append(received - parse_rfc3339(answered_at))
                cycles[0] += 1

        cpu0 = time.process_time()
        cycle_seconds = await workers(caller)
        client_cpu = (time.process_time() - cpu0) / cycle_seconds
    finally:
        await http.close()
    return {
        "concurrency": concurrency,
        "asks": len(asked),
        "asks_per_second": len(asked) / asks_seconds,
        "answers": answered[0],
        "answers_per_second": answered[0] / answers_seconds,
        "answers_phase_wake_ms": summary_ms(backlog_wake),
        "cycles": cycles[0],
        "cycles_per_second": cycles[0] / cycle_seconds,
        "wake_ms": summary_ms(wake),
        "commit_wake_ms": summary_ms(commit_wake),
        "client_cpu_fraction_cycle": client_cpu,
        "failures": failures[:5],
    }


def main() -> None:
    job = json.loads(sys.stdin.read())
    concurrency = int(job.get("concurrency", 16))
    seconds = float(job.get("seconds", 5))
    result: dict[str, Any] = {}
    if job.get("service_url"):
        try:
            import uvloop

            result["ours"] = uvloop.run(run_ours(job, concurrency, seconds))
        except ImportError:
            result["ours"] = asyncio.run(run_ours(job, concurrency, seconds))
    if job.get("pg_url"):
        result["dbos"] = run_dbos(job["pg_url"], concurrency, seconds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
