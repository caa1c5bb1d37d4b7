"""The web inbox: `/` and the files of service/web, served from memory with strict headers.

The page is plain HTML, CSS and ES modules (no build step, no third-party script). Every reply
carries a Content-Security-Policy that allows only this origin's scripts, styles, images and
connections, and no inline code, so a prompt that smuggles markup cannot run. Files are read once,
tagged with a strong ETag from their content and served with `Cache-Control: no-cache`: the
browser revalidates each load (a cheap 304) and never runs a stale script after an upgrade.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from aiohttp import web

from service.errors import NotFound

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
INDEX = "index.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


@cache
def assets() -> dict[str, Asset]:
    """Every servable file of service/web by name; nothing else can be asked for."""
    found = {}
    for path in sorted(WEB_DIR.iterdir()):
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.is_file():
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        found[path.name] = Asset(body, content_type, etag)
    return found


def serve(request: web.Request, name: str) -> web.Response:
    asset = assets().get(name)
    if asset is None:
        raise NotFound(f"no file {name!r} in the web inbox")
    headers = {**SECURITY_HEADERS, "Cache-Control": "no-cache", "ETag": asset.etag}
    tags = _etags(request.headers.get("If-None-Match", ""))
    if asset.etag in tags or "*" in tags:  # "*" matches any current representation
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",")}


async def inbox(request: web.Request) -> web.Response:
    """The inbox page; it signs in with a token kept in the browser (see docs/inbox.md)."""
    return serve(request, INDEX)


async def web_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == INDEX:  # the page has one address, `/`
        raise NotFound(f"no file {name!r} in the web inbox: the inbox page is /")
    return serve(request, name)
