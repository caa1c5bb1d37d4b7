"""The server side of the web inbox, without a browser: its files, their headers, `/v1/me`, and
the sign-in link the admin command prints."""

from __future__ import annotations

import re

import pytest

from service.http.web import WEB_DIR
from service.settings import Settings
from tests.api import Api
from tests.test_cli import cli

TYPES = {
    "/": "text/html; charset=utf-8",
    "/web/app.js": "text/javascript; charset=utf-8",
    "/web/api.js": "text/javascript; charset=utf-8",
    "/web/stories.js": "text/javascript; charset=utf-8",
    "/web/style.css": "text/css; charset=utf-8",
    "/web/favicon.svg": "image/svg+xml",
}


@pytest.mark.parametrize(("path", "content_type"), TYPES.items())
async def test_each_inbox_file_has_its_type_a_strict_csp_and_revalidates(
    api: Api, path: str, content_type: str
) -> None:
    reply = await api.call("GET", path)

    assert reply.status == 200
    assert reply.headers["Content-Type"] == content_type
    csp = reply.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp
    assert "default-src 'none'" in csp
    assert "unsafe" not in csp
    assert reply.headers["X-Content-Type-Options"] == "nosniff"
    assert reply.headers["Cache-Control"] == "no-cache"
    name = "index.html" if path == "/" else path.removeprefix("/web/")
    assert reply.body == (WEB_DIR / name).read_bytes()

    for condition in (reply.headers["Etag"], f'"other", {reply.headers["Etag"]}', "*"):
        again = await api.call("GET", path, headers={"If-None-Match": condition})
        assert again.status == 304, condition  # "*": any current representation (RFC 9110)
        assert again.body == b""
    changed = await api.call("GET", path, headers={"If-None-Match": '"other"'})
    assert changed.status == 200


async def test_the_page_loads_only_its_own_files_and_runs_no_inline_code(api: Api) -> None:
    page = (await api.call("GET", "/")).body.decode()

    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources == ["/web/favicon.svg", "/web/style.css", "/web/app.js"]
    assert re.search(r"<script(?![^>]*\bsrc=)", page) is None, "an inline script"
    assert "<style" not in page
    assert " style=" not in page
    assert re.search(r"\son[a-z]+=", page) is None, "an inline event handler"


@pytest.mark.parametrize(
    "path", ["/web/nothing.js", "/web/..%2F__init__.py", "/web/web.py", "/web/index.html"]
)  # the page itself has one address, /
async def test_anything_but_the_inbox_files_is_a_404_problem(api: Api, path: str) -> None:
    reply = await api.call("GET", path)

    assert reply.status == 404
    assert reply.headers["Content-Type"].startswith("application/problem+json")


async def test_me_names_the_principal_of_the_token(api: Api) -> None:
    token = await api.principal("alice", "user")

    reply = await api.call("GET", "/v1/me", token)

    assert reply.status == 200
    assert reply.body == {"principal": {"id": "alice", "kind": "user", "display_name": ""}}
    assert (await api.call("GET", "/v1/me")).status == 401


async def test_a_sign_in_link_carries_a_new_user_token_in_the_fragment(api: Api, settings: Settings) -> None:
    await api.principal("alice", "user")
    await api.principal("deploybot", "agent")

    printed = cli(settings, "admin", "sign-in-link", "alice", "--base-url", "https://inbox.example/")

    assert printed.returncode == 0, printed.stderr
    link = printed.stdout.strip()
    match = re.fullmatch(r"https://inbox\.example/#token=(qs_[A-Za-z0-9_-]+)", link)
    assert match, link
    me = await api.call("GET", "/v1/me", match.group(1))
    assert me.body["principal"]["id"] == "alice"

    for refused in ("deploybot", "nobody"):
        denied = cli(settings, "admin", "sign-in-link", refused)
        assert denied.returncode == 1
        assert denied.stdout == ""
    assert "sign-in links are for users" in cli(settings, "admin", "sign-in-link", "deploybot").stderr
