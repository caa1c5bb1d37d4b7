"""`question-service mcp`: an MCP server on stdio that lets an agent ask a person and wait.

Tools: `ask_human` (asks, then blocks until the question is answered, expired or cancelled, and
returns the terminal envelope), `get_question` and `cancel_question`. It is a client of a running
Question Service (QS_URL, QS_TOKEN with an agent token); it never touches Redis. Needs the `mcp`
package (`pip install 'question-service[mcp]'`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from service.client import AsyncClient, ProblemError, Retry, TransportError, WaitTimeout

log = logging.getLogger(__name__)
# While ask_human waits it reports progress this often, so hosts that time out idle calls see life.
PROGRESS_EVERY_SECONDS = 15.0


def build_server(client: AsyncClient) -> MCPServer:
    """The MCPServer with the three tools bound to `client`."""
    server = MCPServer(
        "question-service",
        instructions=(
            "Ask a person to choose between options and wait for their answer. Use ask_human when "
            "you need a human decision or approval; it blocks until the person answers, the "
            "deadline passes or the question is cancelled."
        ),
    )

    @server.tool()
    async def ask_human(
        prompt: str, options: list[str], to: str, ctx: Context, timeout: str = "10m"
    ) -> dict[str, Any]:
        """Ask a person a question and wait for the outcome.

        prompt: the question, in full sentences. options: 2 to 10 choices (short ids like
        "deploy", or short text). to: "user:ID" or "room:ID" (any room member may answer).
        timeout: how long the person has, like "30s", "10m", "2h" (default 10m).
        Returns the final question: state is "answered" (answer.option is the choice),
        "expired" or "cancelled".
        """
        try:
            question = await client.ask(prompt, options, to=to, timeout=timeout)
            await ctx.report_progress(0, None, f"asked question {question.id}; waiting")
            result = await wait_reporting(client, question.id, ctx)
        except (ProblemError, TransportError, ValueError) as exc:
            raise ToolError(str(exc)) from exc
        return result

    @server.tool()
    async def get_question(question_id: str) -> dict[str, Any]:
        """The current state of a question (pending, answered, expired or cancelled)."""
        try:
            return (await client.get(question_id)).raw
        except (ProblemError, TransportError, ValueError) as exc:
            raise ToolError(str(exc)) from exc

    @server.tool()
    async def cancel_question(question_id: str, reason: str | None = None) -> dict[str, Any]:
        """Cancel a pending question you asked. Returns {"applied", "question"}; applied is false
        when it had already ended."""
        try:
            outcome = await client.cancel(question_id, reason=reason)
        except (ProblemError, TransportError, ValueError) as exc:
            raise ToolError(str(exc)) from exc
        return {"applied": outcome.applied, "question": outcome.question.raw}

    return server


async def wait_reporting(client: AsyncClient, question_id: str, ctx: Context) -> dict[str, Any]:
    """Wait for the terminal envelope, reporting progress between long polls."""
    started = time.monotonic()
    while True:
        try:
            result = await client.wait(question_id, timeout=PROGRESS_EVERY_SECONDS)
        except WaitTimeout:
            waited = time.monotonic() - started
            await ctx.report_progress(waited, None, f"still waiting for {question_id}")
            continue
        return result.envelope


async def serve(url: str | None, token: str | None, retry: Retry) -> None:
    async with AsyncClient(url, token, retry=retry) as client:
        await build_server(client).run_stdio_async()


def main(url: str | None, token: str | None, retry: Retry) -> int:
    """Run on stdio until the host closes it. Logs go to stderr: stdout is the protocol."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(serve(url, token, retry))
    return 0
