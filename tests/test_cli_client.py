"""`python -m service ask|wait|get|list|answer|cancel` as a pipeline would run them: a subprocess
against a live service, with the exit code saying how the question ended."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.client import AsyncClient, User
from service.settings import Settings
from tests.live_service import FAST, Live, populate, serve
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).parent / "question-service"


@dataclass
class Done:
    code: int
    out: str
    err: str


class Cli:
    """Runs the command line with QS_URL/QS_TOKEN for one principal."""

    def __init__(self, url: str, token: str) -> None:
        self.env = {**os.environ, "QS_URL": url, "QS_TOKEN": token}

    async def start(self, *args: str, program: tuple[str, ...] = ()) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *(program or (sys.executable, "-m", "service")), *args, cwd=ROOT, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    async def run(self, *args: str, program: tuple[str, ...] = ()) -> Done:
        process = await self.start(*args, program=program)
        out, err = await process.communicate()
        assert process.returncode is not None
        return Done(process.returncode, out.decode(), err.decode())


async def asked_id(process: asyncio.subprocess.Process) -> str:
    """The id `ask --wait` announces on stderr before it starts waiting."""
    assert process.stderr is not None
    line = (await process.stderr.readline()).decode()
    assert line.startswith("asked "), line
    return line.split()[1].rstrip(";")


async def finished(process: asyncio.subprocess.Process) -> Done:
    out, err = await process.communicate()
    assert process.returncode is not None
    return Done(process.returncode, out.decode(), err.decode())


@pytest.fixture
async def live(settings: Settings) -> AsyncIterator[Live]:
    async with serve(settings) as url:
        yield await populate(url)


@pytest.fixture
def agent_cli(live: Live) -> Cli:
    return Cli(live.url, live.agent)


@pytest.fixture
async def alice(live: Live) -> AsyncIterator[AsyncClient]:
    async with live.client(live.alice) as client:
        yield client


ASK = ("ask", "Deploy v2.3 to prod?", "--option", "deploy", "--option", "abort", "--to", "user:alice")


async def test_ask_wait_exits_0_and_prints_only_the_option(agent_cli: Cli, alice: AsyncClient) -> None:
    process = await agent_cli.start(*ASK, "--timeout", "10m", "--wait", "--print-option")
    question_id = await asked_id(process)
    await alice.answer(question_id, "deploy")
    done = await finished(process)
    assert (done.code, done.out) == (0, "deploy\n")


async def test_ask_wait_json_prints_the_terminal_envelope(
    live: Live, agent_cli: Cli, alice: AsyncClient
) -> None:
    process = await agent_cli.start(*ASK, "--timeout", "10m", "--wait", "--json")
    question_id = await asked_id(process)
    await alice.answer(question_id, "abort")
    done = await finished(process)
    assert done.code == 0
    async with live.client(live.agent) as agent:
        assert json.loads(done.out) == (await agent.get(question_id)).raw


async def test_ask_wait_exits_3_when_the_question_expires(agent_cli: Cli) -> None:
    done = await agent_cli.run(*ASK, "--timeout", "1s", "--wait", "--print-option")
    assert done.code == 3
    assert done.out == ""
    assert "expired" in done.err


async def test_ask_wait_exits_4_when_the_question_is_cancelled(live: Live, agent_cli: Cli) -> None:
    process = await agent_cli.start(*ASK, "--timeout", "10m", "--wait")
    question_id = await asked_id(process)
    async with live.client(live.agent) as agent:
        await agent.cancel(question_id, reason="superseded")
    done = await finished(process)
    assert done.code == 4
    assert "cancelled: by agent" in done.out
    assert "superseded" in done.out


async def test_ask_wait_exits_5_when_max_wait_runs_out(agent_cli: Cli) -> None:
    done = await agent_cli.run(*ASK, "--timeout", "10m", "--wait", "--max-wait", "0.5", "--json")
    assert done.code == 5
    assert json.loads(done.out)["state"] == "pending"


async def test_print_option_keeps_stdout_empty_when_max_wait_runs_out(agent_cli: Cli) -> None:
    """`choice=$(... --print-option)` must not take the pending question's description."""
    done = await agent_cli.run(*ASK, "--timeout", "10m", "--wait", "--print-option", "--max-wait", "0.5")
    assert done.code == 5
    assert done.out == ""
    assert "still pending" in done.err


@pytest.mark.parametrize(
    "args",
    [
        ("ask", "Deploy?", "--option", "deploy", "--to", "user:alice", "--timeout", "1m"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "alice", "--timeout", "1m"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "user:alice", "--timeout", "soon"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "user:alice"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "user:a", "--timeout", "1m", "--metadata", "[1]"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "user:a", "--timeout", "1m", "--print-option"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "user:a", "--timeout", "1m", "--max-wait", "later"),
        ("ask", "Deploy?", "-o", "a", "-o", "b", "--to", "user:a", "--timeout=1m", "--idempotency-key=\xe9"),
        ("frobnicate",),
    ],
)
async def test_bad_usage_exits_2_before_asking_anything(
    live: Live, agent_cli: Cli, args: tuple[str, ...]
) -> None:
    done = await agent_cli.run(*args)
    assert done.code == 2, done.err
    assert done.out == ""
    async with live.client(live.agent) as agent:
        assert [q async for q in agent.list()] == []


async def test_a_missing_token_is_a_usage_error(live: Live) -> None:
    cli = Cli(live.url, "")
    done = await cli.run("get", "whatever")
    assert done.code == 2
    assert "QS_TOKEN" in done.err


async def test_an_unreachable_service_exits_1(agent_cli: Cli) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = await agent_cli.run(*ASK, "--timeout", "1m", "--url", url, "--retries", "2")
    assert done.code == 1
    assert "ConnectError" in done.err


async def test_a_refusal_by_the_service_exits_1_with_the_problem(agent_cli: Cli) -> None:
    done = await agent_cli.run("ask", "Hi?", "-o", "a", "-o", "b", "--to", "user:nobody", "--timeout", "1m")
    assert done.code == 1
    assert "422" in done.err
    assert "nobody" in done.err


async def test_ask_without_wait_prints_the_created_question_and_exits_0(agent_cli: Cli, live: Live) -> None:
    done = await agent_cli.run(*ASK, "--timeout", "10m", "--json", "--metadata", '{"build": 7}')
    assert done.code == 0, done.err
    created = json.loads(done.out)
    assert (created["state"], created["metadata"]) == ("pending", {"build": 7})
    text = await agent_cli.run(*ASK, "--timeout", "10m")
    assert text.code == 0
    assert "pending" in text.out.splitlines()[0]
    assert "to:        user:alice" in text.out


async def test_get_list_answer_cancel_and_wait_commands(live: Live, agent_cli: Cli) -> None:
    async with live.client(live.agent, retry=FAST) as agent:
        first = await agent.ask("One?", ["yes", "no"], to=User("alice"), timeout=600)
        second = await agent.ask("Two?", ["yes", "no"], to=User("alice"), timeout=600)
    alice_cli = Cli(live.url, live.alice)

    async with live.client(live.agent, retry=FAST) as agent:
        third = await agent.ask("Three\nlines\x1b[2J?", ["yes", "no"], to=User("alice"), timeout=600)
    listed = (await alice_cli.run("list", "--state", "pending")).out.splitlines()
    assert len(listed) == 3  # one line per question, control characters blanked
    assert listed[0].startswith(third.id)
    assert listed[0].endswith("Three lines [2J?")
    await alice_cli.run("answer", third.id, "no")

    pending = await alice_cli.run("list", "--role", "responder", "--state", "pending", "--json")
    assert [json.loads(line)["id"] for line in pending.out.splitlines()] == [second.id, first.id]
    assert len((await agent_cli.run("list", "--limit", "1")).out.splitlines()) == 1

    answered = await alice_cli.run("answer", first.id, "yes", "--json")
    assert answered.code == 0
    assert json.loads(answered.out)["applied"] is True
    again = await alice_cli.run("answer", first.id, "no")
    assert again.code == 0
    assert "not applied" in again.err

    cancelled = await agent_cli.run("cancel", second.id, "--reason", "enough", "--json")
    assert json.loads(cancelled.out)["question"]["cancellation"] == {"by": "agent", "reason": "enough"}

    assert (await agent_cli.run("wait", first.id, "--print-option")).out == "yes\n"
    assert (await agent_cli.run("wait", second.id)).code == 4
    fetched = await agent_cli.run("get", first.id, "--json")
    assert json.loads(fetched.out)["answer"]["option"] == "yes"
    missing = await agent_cli.run("get", "nosuchquestion")
    assert missing.code == 1
    assert "404" in missing.err


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="the console script is not installed in this venv")
async def test_the_console_script_is_the_same_program(agent_cli: Cli, alice: AsyncClient) -> None:
    process = await agent_cli.start(
        *ASK, "--timeout", "10m", "--wait", "--print-option", program=(str(CONSOLE_SCRIPT),)
    )
    await alice.answer(await asked_id(process), "abort")
    done = await finished(process)
    assert (done.code, done.out) == (0, "abort\n")
