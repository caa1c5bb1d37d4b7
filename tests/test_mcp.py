"""`python -m service mcp`: the MCP server over stdio, driven by the MCP client of the same
package, against a live service. ask_human blocks until a person answers through the API."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.types import CallToolResult, TextContent

from service.client import AsyncClient, User
from service.settings import Settings
from tests.live_service import Live, new_questions, populate, serve

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def live(settings: Settings) -> AsyncIterator[Live]:
    async with serve(settings) as url:
        yield await populate(url)


@asynccontextmanager
async def mcp_server(url: str, token: str) -> AsyncIterator[Client]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "service", "mcp", "--retries", "3"],
        env={"QS_URL": url, "QS_TOKEN": token, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    async with Client(params) as client:
        yield client


def text(result: CallToolResult) -> str:
    (content,) = result.content
    assert isinstance(content, TextContent)
    return content.text


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    content: dict[str, Any] = result.structured_content
    return content


async def test_the_server_lists_its_three_tools(live: Live) -> None:
    async with mcp_server(live.url, live.agent) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == {"ask_human", "get_question", "cancel_question"}
    assert set(tools["ask_human"].input_schema["required"]) == {"prompt", "options", "to"}
    assert "ctx" not in tools["ask_human"].input_schema["properties"]


async def test_ask_human_blocks_until_a_person_answers_and_returns_the_envelope(live: Live) -> None:
    async with (
        mcp_server(live.url, live.agent) as client,
        new_questions(live.url, live.alice) as next_question,
        AsyncClient(live.url, live.alice) as alice,
    ):
        messages: list[str | None] = []

        async def report(progress: float, total: float | None, message: str | None) -> None:
            messages.append(message)

        arguments = {"prompt": "Deploy v2.3?", "options": ["deploy", "abort"], "to": "user:alice"}
        asking = asyncio.create_task(
            client.call_tool("ask_human", {**arguments, "timeout": "5m"}, progress_callback=report)
        )
        created = asyncio.ensure_future(next_question())
        await asyncio.wait([created, asking], return_when=asyncio.FIRST_COMPLETED)
        assert not asking.done(), asking.result()  # blocked until someone answers
        question_id = created.result()
        await alice.answer(question_id, "deploy")
        envelope = structured(await asking)
        fetched = await alice.get(question_id)
    assert envelope["state"] == "answered"
    assert envelope["answer"]["option"] == "deploy"
    assert envelope == fetched.raw
    assert f"asked question {question_id}; waiting" in messages


async def test_ask_human_returns_expired_when_nobody_answers(live: Live) -> None:
    async with mcp_server(live.url, live.agent) as client:
        arguments = {"prompt": "Anyone?", "options": ["Yes", "No"], "to": "room:ops", "timeout": "1s"}
        envelope = structured(await client.call_tool("ask_human", arguments))
    assert envelope["state"] == "expired"
    assert [o["id"] for o in envelope["options"]] == ["yes", "no"]


async def test_get_and_cancel_question_tools(live: Live) -> None:
    async with AsyncClient(live.url, live.agent) as agent:
        question = await agent.ask("Rotate keys?", ["yes", "no"], to=User("alice"), timeout="1h")
    async with mcp_server(live.url, live.agent) as client:
        got = structured(await client.call_tool("get_question", {"question_id": question.id}))
        cancelled = structured(
            await client.call_tool("cancel_question", {"question_id": question.id, "reason": "done"})
        )
    assert got == question.envelope.raw
    assert cancelled["applied"] is True
    assert cancelled["question"]["cancellation"] == {"by": "agent", "reason": "done"}


async def test_a_refused_question_is_a_tool_error_naming_the_problem(live: Live) -> None:
    async with mcp_server(live.url, live.agent) as client:
        bad_target = await client.call_tool(
            "ask_human", {"prompt": "Hi?", "options": ["yes", "no"], "to": "user:nobody"}
        )
        unknown = await client.call_tool("get_question", {"question_id": "nosuchquestion"})
    assert bad_target.is_error
    assert "422" in text(bad_target)
    assert unknown.is_error
    assert "404" in text(unknown)
