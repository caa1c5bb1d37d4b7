"""The README's walk-through, run as written: its shell blocks in order, in one bash, with curl
and jq, against a live service; each block's output must be the output the README shows after
it, once ids, times, tokens and cursors are masked. A newcomer pastes these blocks: they must work."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import ADMIN_TOKEN, test_settings
from tests.live_service import serve
from tests.redis_server import RedisServer

README = Path(__file__).resolve().parent.parent / "README.md"
DOCUMENTED_URL = "http://127.0.0.1:8080"
MARK = "@@ end of block @@"
MASKS = (
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"), "<time>"),
    (re.compile(r'"token":"qs_[0-9a-f]{12}_[A-Za-z0-9_-]+"'), '"token":"<token>"'),
    (re.compile(r'"token_id":"[0-9a-f]{12}"'), '"token_id":"<token id>"'),
    (re.compile(r'"next_cursor":"[A-Za-z0-9_=-]+"'), '"next_cursor":"<cursor>"'),
    (re.compile(r'"[0-9a-f]{25}"'), '"<id>"'),
)


def walkthrough_blocks() -> list[tuple[str, list[str] | None]]:
    """Each `sh` block of the section, with the output block that follows it (None if none)."""
    text = README.read_text()
    section = text.split("\n## Walk-through\n", 1)[1].split("\n## ", 1)[0]
    fences = re.findall(r"^```(\w*)\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    blocks: list[tuple[str, list[str] | None]] = []
    for language, body in fences:
        if language == "sh":
            blocks.append((body, None))
        elif blocks and blocks[-1][1] is None:
            blocks[-1] = (blocks[-1][0], body.splitlines())
    return blocks


def masked(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for pattern, mask in MASKS:
            line = pattern.sub(mask, line)
        out.append(line)
    return sorted(out)  # a background waiter's line may come before or after its neighbour's


def test_the_walkthrough_has_its_blocks_and_their_outputs() -> None:
    blocks = walkthrough_blocks()
    assert len(blocks) >= 10
    assert sum(output is not None for _, output in blocks) >= 8


async def test_the_readme_walkthrough_runs_as_written(redis_server: RedisServer, tmp_path: Path) -> None:
    missing = " ".join(tool for tool in ("bash", "curl", "jq") if shutil.which(tool) is None)
    if missing and os.environ.get("CI") != "true":
        pytest.skip(reason=f"the walk-through needs {missing} (Debian: apt-get install {missing})")
    assert not missing, f"CI installs what the walk-through needs, but {missing} is missing"
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "admin-token").write_text(ADMIN_TOKEN + "\n")
    blocks = walkthrough_blocks()
    async with serve(test_settings(redis_server.url, wait_max_seconds=60)) as url:
        script = "set -e -o pipefail\n" + "".join(
            f"{body.replace(DOCUMENTED_URL, url)}\necho '{MARK}'\n" for body, _ in blocks
        )
        shell = await asyncio.create_subprocess_exec(
            "bash", "-c", script, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        async with asyncio.timeout(60):
            stdout, stderr = await shell.communicate()
    assert shell.returncode == 0, stderr.decode()
    outputs = stdout.decode().split(MARK + "\n")
    assert len(outputs) == len(blocks) + 1, outputs
    for n, ((body, expected), got) in enumerate(zip(blocks, outputs, strict=False), 1):
        if expected is not None:
            assert masked(got.splitlines()) == masked(expected), f"block {n}:\n{body}"
