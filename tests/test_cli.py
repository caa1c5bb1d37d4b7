"""The command line: admin bootstrap straight against Redis, a one-shot sweep, and `serve`'s app."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from service.__main__ import YOUNG_GENERATION_THRESHOLD, serving_app
from service.settings import Settings
from tests.conftest import close_client
from tests.redis_server import free_port


def cli(
    settings: Settings, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "QS_REDIS_URL": settings.redis_url,
        "QS_KEY_PREFIX": settings.key_prefix,
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "service", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_admin_commands_bootstrap_principals_tokens_and_rooms(settings: Settings) -> None:
    created = cli(settings, "admin", "create-principal", "alice", "--kind", "user")
    assert created.returncode == 0, created.stderr
    body = json.loads(created.stdout)
    assert body["principal"] == {"id": "alice", "kind": "user", "display_name": ""}
    assert body["token"].startswith("qs_" + body["token_id"])

    again = cli(settings, "admin", "create-principal", "alice", "--kind", "user")
    assert again.returncode == 1
    assert "already exists" in again.stderr

    for lifetime in ("0", "-5", "999999999999999"):  # the HTTP route's bounds: 1 s to 10 years
        refused = cli(settings, "admin", "issue-token", "alice", "--expires-in", lifetime)
        assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
        assert "expires_in must be 1 to" in refused.stderr
    issued = json.loads(cli(settings, "admin", "issue-token", "alice", "--expires-in", "60").stdout)
    assert issued["expires_in"] == 60
    revoked = cli(settings, "admin", "revoke-token", "qs_" + issued["token_id"])
    assert revoked.returncode == 0, revoked.stderr
    assert cli(settings, "admin", "revoke-token", issued["token_id"]).returncode == 1

    room = json.loads(cli(settings, "admin", "set-room", "ops", "alice").stdout)
    assert room == {"room": "ops", "members": ["alice"]}
    assert cli(settings, "admin", "remove-member", "ops", "alice").returncode == 0
    assert cli(settings, "admin", "remove-member", "ops", "alice").returncode == 1
    assert json.loads(cli(settings, "admin", "add-member", "ops", "alice").stdout)["members"] == ["alice"]
    assert json.loads(cli(settings, "admin", "show-room", "ops").stdout)["members"] == ["alice"]
    unknown_user = cli(settings, "admin", "set-room", "ops", "nobody")
    assert unknown_user.returncode == 1
    assert "not a user principal" in unknown_user.stderr


def test_sweep_once_reports_what_it_did(settings: Settings) -> None:
    swept = cli(settings, "sweep", "--once")
    assert swept.returncode == 0, swept.stderr
    assert json.loads(swept.stdout) == {"expired": 0, "purged": 0}


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("QS_LOG_LEVEL", "bogus"),
        ("QS_REDIS_URL", "foo://x"),
        ("QS_REDIS_URL", "redis://127.0.0.1:notaport/0"),
        ("QS_REDIS_TIMEOUT_SECONDS", "nan"),
        ("QS_AUTH_CACHE_SECONDS", "nan"),  # a cache whose entries never expired
        ("QS_RETENTION_SECONDS", "99999999999999999"),  # every create was a 500
        ("QS_IDEMPOTENCY_TTL_SECONDS", "99999999999999999"),
        ("QS_WEBHOOK_RETRY_SCHEDULE", "nan,inf"),
    ],
)
def test_a_bad_setting_value_is_one_line_naming_it_and_exit_2(
    settings: Settings, variable: str, value: str
) -> None:
    """Each of these was a traceback at start (or a silent acceptance that failed later)."""
    done = cli(settings, "sweep", "--once", env={variable: value})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ")
    assert variable in done.stderr


@pytest.mark.parametrize("command", [("stats",), ("sweep", "--once"), ("admin", "show-room", "ops")])
def test_a_command_says_in_one_line_that_redis_is_unreachable(
    settings: Settings, command: tuple[str, ...]
) -> None:
    env = {"QS_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "QS_REDIS_TIMEOUT_SECONDS": "1"}
    done = cli(settings, *command, env=env)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: Redis: ")


def test_a_bad_setting_exits_2_and_names_the_variable(settings: Settings) -> None:
    bad = cli(settings, "sweep", "--once", "--sweep-interval-seconds", "5")
    assert bad.returncode == 2
    assert "QS_SWEEP_INTERVAL_SECONDS" in bad.stderr
    worse = cli(settings, "sweep", "--once", "--port", "many")
    assert worse.returncode == 2
    assert "QS_PORT" in worse.stderr


async def test_serve_freezes_what_startup_made_and_collects_the_young_generation_less_often(
    settings: Settings,
) -> None:
    gc.unfreeze()
    thresholds = gc.get_threshold()
    client: TestClient[object, object] = TestClient(TestServer(serving_app(settings)))
    await client.start_server()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the modules, scripts, pools and routes of a started service
        assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, *thresholds[1:])
        assert thresholds[0] < YOUNG_GENERATION_THRESHOLD
        assert (await client.get("/healthz")).status == 200
    finally:
        gc.unfreeze()  # the other tests' apps come and go: none of theirs may stay frozen
        gc.set_threshold(*thresholds)
        await close_client(client)
