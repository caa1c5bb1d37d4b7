"""JSON and msgpack on the wire: reading request bodies and negotiating response bodies."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import Any

import msgpack
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from service.errors import BodyTimeout, Malformed, TooLarge, UnsupportedMediaType
from service.http.appkeys import SETTINGS
from service.model import as_envelope, to_json

JSON = "application/json"
MSGPACK = "application/msgpack"
PROBLEM = "application/problem+json"
_MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """An object that names a key twice: which value was meant is not a thing to guess (RFC 8259
    leaves it to the reader; a proxy or a signature check upstream may have read the other)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        repeated = sorted(str(key) for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise Malformed(f"the body names the keys {repeated} more than once in one object")
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_lone_surrogates(value: Any) -> None:
    """JSON may escape half of a UTF-16 pair (\\ud800); such text cannot be stored as UTF-8."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise Malformed("the body contains a lone UTF-16 surrogate escape") from exc


def decode(raw: bytes, content_type: str) -> Any:
    if not raw:
        raise Malformed("the request needs a body")
    if content_type in _MSGPACK_TYPES:
        try:
            return msgpack.unpackb(
                raw, raw=False, strict_map_key=True, ext_hook=_reject_ext, object_pairs_hook=_unique_keys
            )
        except msgpack.StackError as exc:  # its message is empty
            raise Malformed("the body's msgpack nests too deeply") from exc
        except msgpack.FormatError as exc:  # its message is empty too
            raise Malformed("the body is not valid msgpack: it holds a reserved byte") from exc
        except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
            raise Malformed(f"the body is not valid msgpack: {exc or type(exc).__name__}") from exc
    if content_type == JSON or content_type.endswith("+json"):
        try:
            # Decoded strictly first: json.loads(bytes) lets UTF-8-encoded surrogates through.
            value = json.loads(raw.decode(), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            if "integer string conversion" in str(exc):  # Python's own advice is not the client's
                raise Malformed("the body holds a number of more than 4300 digits") from exc
            raise Malformed(f"the body is not valid JSON: {exc}") from exc
        if _SURROGATE_ESCAPE.search(raw):
            _reject_lone_surrogates(value)
        return value
    raise UnsupportedMediaType(f"cannot read {content_type or 'a body without Content-Type'}")


# The codings aiohttp decodes without optional packages (br and zstd need them).
BODY_CODINGS = frozenset({"", "identity", "gzip", "deflate"})


async def read_body(request: web.Request, *, optional: bool = False) -> Any:
    """The decoded body; for an absent body, {} when the route allows that, else a 400.
    A body that trickles in (slowloris) is cut off after QS_BODY_TIMEOUT_SECONDS with a 408,
    so a client cannot hold a handler for as long as it likes."""
    settings = request.app[SETTINGS]
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in BODY_CODINGS:
        # aiohttp passes a coding it does not know through undecoded, as if it were identity.
        raise UnsupportedMediaType(
            f"Content-Encoding {coding!r} is not supported: send identity, gzip or deflate"
        )
    if (request.content_length or 0) > settings.max_body_bytes:  # said before it is sent
        raise TooLarge(f"the body exceeds {settings.max_body_bytes} bytes")
    try:
        if request.content.is_eof():  # the whole body came with the headers: no timer to arm
            raw = await request.read()
        else:
            async with asyncio.timeout(settings.body_timeout_seconds):
                raw = await request.read()
    except TimeoutError as exc:
        raise BodyTimeout(f"the body did not arrive within {settings.body_timeout_seconds:g} s") from exc
    except web.HTTPRequestEntityTooLarge as exc:
        raise TooLarge(f"the body exceeds {settings.max_body_bytes} bytes") from exc
    except RequestPayloadError as exc:  # a Content-Encoding the body does not match
        # The rest of the body cannot be decoded either: end it here and close the connection
        # after the reply, rather than let aiohttp read it again (to keep the connection alive)
        # and log the same error as an unhandled exception.
        request.content.feed_eof()
        request.protocol.close()
        raise Malformed(f"the body is not valid {coding} data, as its Content-Encoding says") from exc
    if not raw and optional:
        return {}
    return decode(raw, request.content_type)


def wants_msgpack(request: web.Request) -> bool:
    """True when `Accept` prefers a msgpack type; a type with `q=0` (or a q outside 0-1, or one
    that is not a number) is not acceptable at all (RFC 9110 section 12.4.2)."""
    accept = request.headers.get("Accept", "")
    if not accept:
        return False
    best: tuple[float, bool] = (-1.0, False)
    for part in accept.split(","):
        media, _, params = part.strip().partition(";")
        quality = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.lower() == "q":  # parameter names are case-insensitive (RFC 9110 5.6.6)
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if not 0.0 < quality <= 1.0:
            continue
        media = media.strip().lower()
        if media in _MSGPACK_TYPES and quality > best[0]:
            best = (quality, True)
        elif media in (JSON, "application/*", "*/*") and quality > best[0]:
            best = (quality, False)
    return best[1]


def respond(
    request: web.Request, body: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    if wants_msgpack(request):
        payload, content_type = msgpack.packb(body, use_bin_type=True, default=as_envelope), MSGPACK
    else:
        payload, content_type = to_json(body), JSON
    # content_type in the constructor: setting it afterwards parses the header again (0.8 µs)
    return web.Response(body=payload, status=status, headers=headers, content_type=content_type)
