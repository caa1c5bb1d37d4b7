"""`question-service ask|wait|get|list|answer|cancel|mcp`: the SDK for shell pipelines.

These talk to a running service over HTTP (QS_URL, QS_TOKEN, or --url/--token), never to Redis.
Exit codes: 0 answered (or done), 1 any other error, 2 usage, 3 expired, 4 cancelled,
5 still pending when --max-wait ran out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a command runs, so `serve` and `admin` do not load httpx
    from service.client import Client, Envelope, Outcome, Result
    from service.client.models import Target

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_EXPIRED, EXIT_CANCELLED, EXIT_PENDING = 0, 1, 2, 3, 4, 5
EXIT_BY_STATE = {"answered": EXIT_OK, "expired": EXIT_EXPIRED, "cancelled": EXIT_CANCELLED}
COMMANDS = frozenset({"ask", "wait", "get", "list", "answer", "cancel", "mcp"})


class UsageError(Exception):
    """Flags that parse but make no sense together (exit 2, like argparse's own errors)."""


def connection_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("connection")
    group.add_argument("--url", help="service base URL (default: QS_URL)")
    group.add_argument("--token", help="bearer token (default: QS_TOKEN)")
    group.add_argument(
        "--retries", type=int, default=8, help="tries per request on connection errors and 5xx (8)"
    )
    return parent


def output_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parent


def waiting_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--max-wait", type=duration, metavar="DURATION", help="stop waiting after this long (exit 5)"
    )
    parent.add_argument("--print-option", action="store_true", help="print only the chosen option on stdout")
    return parent


def add_commands(sub: Any) -> None:
    """Register the client subcommands on `question-service`'s subparsers."""
    conn, out, waits = connection_flags(), output_flags(), waiting_flags()
    ask = sub.add_parser("ask", parents=[conn, out, waits], help="ask a question (and --wait for the answer)")
    ask.add_argument("prompt")
    ask.add_argument("--option", "-o", action="append", required=True, help="an option (2 to 10)")
    ask.add_argument("--to", type=target, required=True, help="user:ID or room:ID")
    ask.add_argument("--timeout", type=duration, required=True, help="deadline: 30s, 10m, 2h, 1d or seconds")
    ask.add_argument("--metadata", type=json_object, help="a JSON object stored with the question")
    ask.add_argument("--idempotency-key", help="retrying with the same key returns the same question")
    ask.add_argument("--wait", action="store_true", help="block until answered, expired or cancelled")
    wait = sub.add_parser("wait", parents=[conn, out, waits], help="block until a question ends")
    wait.add_argument("id")
    get = sub.add_parser("get", parents=[conn, out], help="print one question")
    get.add_argument("id")
    listing = sub.add_parser("list", parents=[conn, out], help="list questions, newest first")
    listing.add_argument("--state", choices=["pending", "answered", "expired", "cancelled"])
    listing.add_argument("--role", choices=["asker", "responder"])
    listing.add_argument("--room", help="a room's questions (admins)")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    answer = sub.add_parser("answer", parents=[conn, out], help="answer a question (user token)")
    answer.add_argument("id")
    answer.add_argument("option")
    cancel = sub.add_parser("cancel", parents=[conn, out], help="cancel a question you asked")
    cancel.add_argument("id")
    cancel.add_argument("--reason")
    sub.add_parser("mcp", parents=[conn], help="run the MCP server on stdio (for agent hosts)")


def run(args: argparse.Namespace) -> int:
    """Run one client subcommand; the exit code."""
    from service.client import Client, InvalidArgument, ProblemError, Retry, TransportError

    try:
        if args.command == "mcp":
            return run_mcp(args)
        with Client(args.url, args.token, retry=Retry(attempts=args.retries)) as client:
            return HANDLERS[args.command](client, args)
    except (UsageError, InvalidArgument) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ProblemError, TransportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def run_mcp(args: argparse.Namespace) -> int:
    from service.client import Retry

    try:
        from service.mcp_server import main as mcp_main
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "mcp":
            raise
        print(
            "error: the MCP server needs the mcp package: pip install 'question-service[mcp]'",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return mcp_main(args.url, args.token, Retry(attempts=args.retries))


def ask(client: Client, args: argparse.Namespace) -> int:
    if len(args.option) < 2:
        raise UsageError("give at least two --option")
    if not args.wait and (args.print_option or args.max_wait is not None):
        raise UsageError("--print-option and --max-wait need --wait")
    question = client.ask(
        args.prompt,
        args.option,
        to=args.to,
        timeout=args.timeout,
        metadata=args.metadata,
        idempotency_key=args.idempotency_key,
    )
    if not args.wait:
        show(question.envelope, args.json)
        return EXIT_OK
    print(f"asked {question.id}; waiting for the answer", file=sys.stderr, flush=True)
    return finish(client, question.id, args)


def wait(client: Client, args: argparse.Namespace) -> int:
    return finish(client, args.id, args)


def finish(client: Client, question_id: str, args: argparse.Namespace) -> int:
    """Wait for the end, print it, and exit with the state's code."""
    from service.client import WaitTimeout

    try:
        result = client.wait(question_id, timeout=args.max_wait)
    except WaitTimeout as exc:
        print(f"still pending after {args.max_wait:g} s: {question_id}", file=sys.stderr)
        if not args.print_option:  # its stdout holds the chosen option or nothing
            show(exc.envelope, args.json)
        return EXIT_PENDING
    if args.print_option:
        print_option(result)
    else:
        show(result.question, args.json)
    return EXIT_BY_STATE[result.state]


def print_option(result: Result) -> None:
    if result.option is not None:
        print(result.option)
        return
    detail = f" by {result.cancelled_by}: {result.cancel_reason or 'no reason'}" if result.cancelled else ""
    print(f"{result.state}{detail} ({result.id})", file=sys.stderr)


def get(client: Client, args: argparse.Namespace) -> int:
    show(client.get(args.id), args.json)
    return EXIT_OK


def list_questions(client: Client, args: argparse.Namespace) -> int:
    """One question per line; --json prints one JSON object per line."""
    for item in client.list(
        state=args.state, role=args.role, room=args.room, page_size=min(args.limit, 200), limit=args.limit
    ):
        if args.json:
            print(json.dumps(item.raw, ensure_ascii=False))
        else:
            print(f"{item.id}  {item.state:<9}  {item.to!s:<20}  {one_line(item.prompt)[:60]}")
    return EXIT_OK


def one_line(text: str) -> str:
    """A prompt on one line: line breaks, tabs and control characters (terminal escapes among
    them) become spaces."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def answer(client: Client, args: argparse.Namespace) -> int:
    show_outcome(client.answer(args.id, args.option), args.json)
    return EXIT_OK


def cancel(client: Client, args: argparse.Namespace) -> int:
    show_outcome(client.cancel(args.id, reason=args.reason), args.json)
    return EXIT_OK


HANDLERS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "ask": ask,
    "wait": wait,
    "get": get,
    "list": list_questions,
    "answer": answer,
    "cancel": cancel,
}


# Argument types: argparse turns their errors into a usage message and exit 2, before any request.


def duration(text: str) -> float:
    from service.client import InvalidArgument, parse_duration

    try:
        return parse_duration(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def target(text: str) -> Target:
    from service.client import InvalidArgument, parse_target

    try:
        return parse_target(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def show(envelope: Envelope, as_json: bool) -> None:
    print(json.dumps(envelope.raw, ensure_ascii=False) if as_json else describe(envelope))


def show_outcome(outcome: Outcome, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"applied": outcome.applied, "question": outcome.question.raw}, ensure_ascii=False))
        return
    if not outcome.applied:
        print(f"not applied: the question was already {outcome.question.state}", file=sys.stderr)
    print(describe(outcome.question))


def describe(envelope: Envelope) -> str:
    raw = envelope.raw
    options = ", ".join(o.id if o.id == o.label else f"{o.id} ({o.label})" for o in envelope.options)
    lines = [
        f"{envelope.id}  {envelope.state}",
        f"  prompt:    {envelope.prompt}",
        f"  options:   {options}",
        f"  to:        {envelope.to}",
        f"  asker:     {envelope.asker}",
        f"  created:   {raw['created_at']}",
        f"  expires:   {raw['expires_at']}",
    ]
    if envelope.answer is not None:
        answer = raw["answer"]
        lines.append(f"  answer:    {answer['option']} by {answer['responder']} at {answer['answered_at']}")
    if envelope.cancellation is not None:
        reason = envelope.cancellation.reason or "no reason given"
        lines.append(f"  cancelled: by {envelope.cancellation.by} at {raw['resolved_at']}: {reason}")
    if envelope.state == "expired":
        lines.append(f"  expired:   {raw['resolved_at']}")
    return "\n".join(lines)
