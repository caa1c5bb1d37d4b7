"""Outgoing HTTP that cannot be turned against the operator's own network.

Webhook URLs come from users, so a URL naming (or resolving to) loopback, a private network, a
link-local or cloud-metadata address is refused unless the operator allow-lists it
(``QS_OUTBOUND_ALLOW_NETS``). The check runs on the addresses the connection is actually made to:
the resolver below hands the connector only addresses that passed, so a name that resolves to a
public address at registration and to 127.0.0.1 at send time (DNS rebinding) is still refused.
Redirects are never followed, and proxies from the environment are ignored.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from service.errors import Invalid

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_URL = 2048
# A receiver's reply body is not used; this much is read so a small reply leaves the connection
# reusable, and a bigger one (or one that never ends) closes it instead of filling memory.
RESPONSE_READ_LIMIT = 64 * 1024
# Not covered by is_private/is_global in every Python version: carrier-grade NAT and the
# IPv6 translation prefixes that can reach IPv4 space.
_ALSO_BLOCKED = [ipaddress.ip_network(n) for n in ("100.64.0.0/10", "64:ff9b::/96", "64:ff9b:1::/48")]


class AddressRefused(aiohttp.ClientError):
    """The URL's host is, or resolves only to, addresses the policy refuses."""


def parse_nets(raw: str) -> tuple[IPNetwork, ...]:
    """`QS_OUTBOUND_ALLOW_NETS`: comma-separated CIDRs (an address alone means just that one)."""
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in raw.split(",") if part.strip())


@dataclass(frozen=True)
class OutboundPolicy:
    allow: tuple[IPNetwork, ...] = ()

    def refuses(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in net for net in self.allow):
            return False
        if address.is_multicast or address.is_reserved or not address.is_global:
            return True
        if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
            return True  # fec0::/10, deprecated, yet still global to Python 3.11
        return any(address in net for net in _ALSO_BLOCKED)

    def check_url(self, url: str) -> str:
        """A syntactically usable http(s) URL whose literal address, if any, is allowed."""
        if len(url) > MAX_URL:
            raise Invalid(f"the URL is longer than {MAX_URL} characters")
        if _SPACE_OR_CONTROL.search(url):
            # urlsplit silently drops tabs and newlines, and aiohttp sends a space in a host as
            # is: either way what was checked would not be what is delivered to.
            raise Invalid("the URL must not contain spaces or control characters")
        try:
            parts = urlsplit(url)
            host = parts.hostname
            port = parts.port  # read now: an out-of-range port is refused here, not at delivery
            sent_host = URL(url).raw_host or ""  # the host as delivery will send it (IDNA)
        except ValueError as exc:  # a bad [IPv6] host or port
            raise Invalid(f"the URL does not parse: {exc}") from exc
        if parts.scheme not in ("http", "https") or not host:
            raise Invalid("the URL must be http:// or https:// with a host")
        if port == 0:
            raise Invalid("the URL's port must be 1-65535")
        if parts.username or parts.password:
            raise Invalid("the URL must not carry credentials")
        # Every check reads the host as delivery sends it: IDNA folds other spellings of
        # digits, dots and letters (full-width, circled, the ideographic full stop) into ASCII,
        # so a full-width 127.0.0.1 is 127.0.0.1 by the time the connection is made.
        literal = _literal_address(sent_host)
        if literal is None and not _HOST_NAME.match(sent_host):
            raise Invalid(f"{host!r} is not a host name: labels of letters, digits, '-' and '_'")
        if literal is None and _LEGACY_IPV4.match(sent_host):
            raise Invalid(f"{host} is an IPv4 address in a legacy form: write it as four decimal parts")
        if (literal is not None and self.refuses(literal)) or sent_host.rstrip(".") == "localhost":
            raise Invalid(f"{host} is a loopback, private, link-local or reserved address")
        return url


# `2130706433`, `127.1`, `0x7f.1`, `0177.0.0.1`: what inet_aton reads as 127.0.0.1. The address
# check only knows dotted quads, and delivery refuses these spellings, so a webhook registered
# with one would only retry until it is dead-lettered. A canonical quad also matches: callers
# ask only when the host is not an address already.
_LEGACY_IPV4 = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}\.?\Z", re.IGNORECASE)


# Every space and every control or format character (C0, DEL, C1, NBSP, the Unicode spaces and
# line separators, zero-width and byte-order marks): none belongs in a URL as typed.
_SPACE_OR_CONTROL = re.compile(
    r"[\s\x00-\x20\x7f-\xa0\u00ad\u180e\u200b-\u200f\u2028-\u202f\u2060-\u206f\ufeff]"
)
# Dot-separated labels of 1-63 characters, at most 253 in all; '_' too, as some internal names use it.
_HOST_NAME = re.compile(r"^(?=.{1,253}\.?\Z)[a-z0-9_-]{1,63}(?:\.[a-z0-9_-]{1,63})*\.?\Z", re.IGNORECASE)


def _literal_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


class GuardedResolver(AbstractResolver):
    """Resolves as usual, then keeps only the addresses the policy allows."""

    def __init__(self, policy: OutboundPolicy) -> None:
        self.policy = policy
        self.inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.inner.resolve(host, port, family)
        allowed = [r for r in found if not self.policy.refuses(ipaddress.ip_address(r["host"]))]
        if not allowed:
            shown = ", ".join(sorted({r["host"] for r in found}))
            raise AddressRefused(f"{host} resolves only to refused addresses ({shown})")
        return allowed

    async def close(self) -> None:
        await self.inner.close()


def new_session(policy: OutboundPolicy) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(resolver=GuardedResolver(policy), limit=100, ttl_dns_cache=10)
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one POST did: a status (0 when no response came) and, on failure, why."""

    status: int
    error: str
    duration_ms: int

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


async def _drain_up_to(response: aiohttp.ClientResponse, limit: int) -> None:
    """Reads and drops at most `limit` bytes of the body; leaving the context closes the
    connection if more is left."""
    left = limit
    while left > 0:
        chunk = await response.content.read(left)
        if not chunk:
            return
        left -= len(chunk)


async def post(
    session: aiohttp.ClientSession,
    policy: OutboundPolicy,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout: float,
) -> Attempt:
    """One POST, never following redirects; every failure becomes an Attempt, not an exception."""
    started = time.monotonic()

    def done(status: int, error: str = "") -> Attempt:
        return Attempt(status, error, round((time.monotonic() - started) * 1000))

    literal = _literal_address(URL(url).raw_host or "")  # as check_url reads it: after IDNA
    if literal is not None and policy.refuses(literal):
        # aiohttp skips the resolver for literal addresses, so they are checked here.
        return done(0, f"refused: {literal} is not an allowed address")
    try:
        async with session.post(
            url,
            data=body,
            headers=dict(headers),
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            # The status decides, once it came: the body is read only so that the connection
            # can be reused, and one that stalls or breaks off changes nothing about the answer.
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                await _drain_up_to(response, RESPONSE_READ_LIMIT)
            if 200 <= response.status < 300:
                return done(response.status)
            return done(response.status, f"HTTP {response.status}")
    except AddressRefused as exc:
        return done(0, f"refused: {exc}")
    except TimeoutError:
        return done(0, f"no response within {timeout:g} s")
    except aiohttp.ClientError as exc:
        return done(0, f"{type(exc).__name__}: {exc}"[:300])
    except ValueError as exc:  # aiohttp refusing a header value or URL it cannot send
        return done(0, f"cannot send: {type(exc).__name__}: {exc}"[:300])
