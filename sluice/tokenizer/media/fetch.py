"""Image reference → bytes: `data:` URIs, `http(s)` URLs under the policy, and allowed local files.

HTTP guarantees: every hop (the URL and each redirect, at most `max_redirects`) is checked for
scheme, domain allowlist and IP literal before it is requested; a hostname is resolved by
`CheckedResolver`, which refuses the host when any of its addresses is refused, and the
connection goes to exactly the addresses it returned (aiohttp connects to the resolver's answer,
so no second lookup can rebind the name). No proxy from the environment, no cookies kept, no
transfer decompression (`Accept-Encoding: identity`); the body is read in chunks and dropped as
soon as it passes `max_image_bytes`, whatever Content-Length said; the whole fetch, redirects
included, runs under `fetch_timeout`. Cancelling the awaiting task closes the connection.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import stat
import urllib.parse
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from sluice.tokenizer.media.policy import (
    IPAddress,
    MediaError,
    MediaPolicy,
    address_refusal,
    is_domain_allowed,
)

# host, port -> the IP addresses it resolves to (as strings); tests inject their own
Resolve = Callable[[str, int], Awaitable[list[str]]]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK_LEN = 64 * 1024
_OFF_LOOP_LEN = 1024 * 1024  # base64 payloads longer than this are decoded in a thread
_HEADERS = {"User-Agent": "sluice", "Accept": "image/*", "Accept-Encoding": "identity"}
_PRIVATE_HINT = " (--allow-private-media-urls lets intranet deployments fetch from it)"


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def describe(url: str) -> str:
    """The URL as quoted in messages: at most 100 characters, a data: URI never in full."""
    if url[:5].lower() == "data:":
        return "the data: URI"
    return url if len(url) <= 100 else url[:97] + "..."


def _refusal_message(shown: str, what: str, ip: IPAddress, reason: str) -> str:
    hint = _PRIVATE_HINT if address_refusal(ip, allow_private=True) is None else ""
    return f"image_url: refused to fetch {shown}: {what} is {reason}{hint}"


class _AddressRefused(OSError):
    """Raised inside aiohttp's connector; carries the client-facing message out of it."""


class CheckedResolver(AbstractResolver):
    """aiohttp resolver that answers only with addresses the policy allows."""

    def __init__(self, resolve: Resolve, allow_private: bool) -> None:
        self._resolve = resolve
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_UNSPEC
    ) -> list[ResolveResult]:
        results: list[ResolveResult] = []
        for text in dict.fromkeys(await self._resolve(host, port)):
            try:
                ip = ipaddress.ip_address(text.split("%")[0])
            except ValueError:
                raise OSError(f"{host} resolves to {text!r}, not an address") from None
            reason = address_refusal(ip, self._allow_private)
            if reason is not None:
                raise _AddressRefused(f"{host} resolves to {ip}, {reason}")
            ip_family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            if family not in (socket.AF_UNSPEC, ip_family):
                continue
            flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
            results.append(
                ResolveResult(
                    hostname=host, host=str(ip), port=port, family=ip_family, proto=0, flags=flags
                )
            )
        if not results:
            raise OSError(f"{host} has no address")
        return results

    async def close(self) -> None:
        pass


def parse_data_uri(url: str, policy: MediaPolicy) -> str:
    """The base64 payload of an image `data:` URI, checked for type and size before decoding."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError(
            "image_url: a data: URI needs a comma before its data", "invalid_image_url"
        )
    media_type, *params = (p.strip().lower() for p in header.split(";"))
    if "base64" not in params:
        raise MediaError(
            "image_url: only base64 data: URIs are accepted (data:image/png;base64,...)",
            "invalid_image_url",
        )
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"image_url: the data: URI is of type {media_type}, not an image")
    payload = "".join(payload.split())
    byte_len = len(payload) * 3 // 4 - len(payload) + len(payload.rstrip("="))
    if byte_len > policy.max_image_bytes:
        raise policy.too_many_bytes("the image in the data: URI", byte_len)
    return payload


def decode_base64(payload: str) -> bytes:
    payload = payload.translate(str.maketrans("-_", "+/"))  # the URL-safe alphabet too
    payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("image_url: the data: URI's data is not valid base64") from None


def _read_file(real_path: str, shown: str, policy: MediaPolicy) -> bytes:
    """At most max_image_bytes of a regular file (blocking: runs in a thread)."""
    # O_NONBLOCK: a FIFO does not wait for a writer; O_NOFOLLOW: no symlink swapped in since
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real_path, flags)
    except OSError as exc:
        raise MediaError(
            f"image_url: cannot open {shown}: {exc.strerror}", "invalid_image_url"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise MediaError(f"image_url: {shown} is not a regular file", "invalid_image_url")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > policy.max_image_bytes:
            raise policy.too_many_bytes(shown, info.st_size)
        data = f.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise policy.too_many_bytes(shown)
    return data


async def read_local_file(url: str, policy: MediaPolicy) -> bytes:
    """A file:// URL's bytes, when its real path (symlinks resolved) is inside the allowed
    directory."""
    root = policy.allowed_local_path
    if root is None:
        raise MediaError(
            "image_url: local files are refused (the server was not started with "
            "--allowed-local-media-path)",
            "image_url_refused",
        )
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"image_url: a file:// URL names no host; got {parts.netloc!r}")
    shown = urllib.parse.unquote(parts.path)
    if "\x00" in shown or not os.path.isabs(shown):
        raise MediaError(f"image_url: {describe(url)} is not an absolute file path")
    real = os.path.realpath(shown)
    if os.path.commonpath([real, root]) != root:
        raise MediaError(
            f"image_url: {describe(shown)} is outside the directory allowed by "
            "--allowed-local-media-path",
            "image_url_refused",
        )
    return await asyncio.to_thread(_read_file, real, describe(shown), policy)


class MediaFetcher:
    """Bytes of an image reference. Owns one aiohttp session, created in the running loop at
    the first http(s) fetch and closed by `close()`."""

    def __init__(self, policy: MediaPolicy, resolve: Resolve = system_resolve) -> None:
        self.policy = policy
        self._resolve = resolve
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, url: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            payload = parse_data_uri(url, self.policy)
            if len(payload) > _OFF_LOOP_LEN:
                return await asyncio.to_thread(decode_base64, payload)
            return decode_base64(payload)
        if scheme in ("http", "https"):
            return await self._fetch_http(url)
        if scheme == "file":
            return await read_local_file(url, self.policy)
        what = f"the URL scheme {scheme!r}" if scheme else f"{describe(url)!r} (not a URL)"
        raise MediaError(
            f"image_url: {what} is not supported; send an http(s) URL or a data: URI",
            "invalid_image_url",
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=CheckedResolver(self._resolve, self.policy.allow_private),
                use_dns_cache=False,  # every connection resolves (and checks) again
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None),  # fetch_timeout covers it all
                auto_decompress=False,
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                headers=_HEADERS,
            )
        return self._session

    async def _fetch_http(self, url: str) -> bytes:
        try:
            async with asyncio.timeout(self.policy.fetch_timeout):
                return await self._follow(url)
        except TimeoutError:
            raise MediaError(
                f"image_url: fetching {describe(url)} took longer than "
                f"{self.policy.fetch_timeout:g} s (--media-fetch-timeout)",
                "image_fetch_failed",
            ) from None

    async def _follow(self, url: str) -> bytes:
        """The body at the end of at most `max_redirects` redirects, each hop checked."""
        try:
            target = URL(url)
        except ValueError:
            raise MediaError(
                f"image_url: {describe(url)} is not a valid URL", "invalid_image_url"
            ) from None
        shown = describe(url)
        for _ in range(self.policy.max_redirects + 1):
            self._check_hop(shown, target)
            try:
                body, location = await self._get(shown, target)
            except aiohttp.ClientConnectorError as exc:
                cause = getattr(exc, "os_error", None)  # certificate errors carry none
                if isinstance(cause, _AddressRefused):
                    raise MediaError(
                        f"image_url: refused to fetch {shown}: {cause}", "image_url_refused"
                    ) from None
                raise self._failed(shown, str(cause or exc)) from None
            except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a malformed answer
                raise self._failed(shown, f"{type(exc).__name__}: {exc}") from None
            if body is not None:
                return body
            try:
                target = target.join(URL(location))
            except ValueError:
                raise self._failed(shown, f"a redirect to an invalid URL {location!r}") from None
            shown = f"{describe(url)} (redirected to {describe(str(target))})"
        raise MediaError(
            f"image_url: {describe(url)} redirects more than {self.policy.max_redirects} times",
            "image_fetch_failed",
        )

    def _check_hop(self, shown: str, target: URL) -> None:
        """Scheme, domain allowlist and IP literal of one hop; `shown` names it in messages."""
        if target.scheme not in ("http", "https"):
            raise MediaError(
                f"image_url: refused to fetch {shown}: only http and https are fetched",
                "image_url_refused",
            )
        host = target.raw_host
        if not host:
            raise MediaError(f"image_url: {shown} has no host", "invalid_image_url")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            ip = None  # a name: CheckedResolver judges its addresses
        reason = None if ip is None else address_refusal(ip, self.policy.allow_private)
        if ip is not None and reason is not None:
            raise MediaError(_refusal_message(shown, host, ip, reason), "image_url_refused")
        if not is_domain_allowed(host, self.policy.allowed_domains):
            raise MediaError(
                f"image_url: refused to fetch {shown}: the host {host} is not in "
                "--allowed-media-domains",
                "image_url_refused",
            )

    async def _get(self, shown: str, target: URL) -> tuple[bytes | None, str]:
        """(body, "") for a success, (None, Location) for a redirect; raises otherwise."""
        async with self._get_session().get(target, allow_redirects=False) as resp:
            if resp.status in _REDIRECTS:
                location = resp.headers.get("Location")
                if not location:
                    raise self._failed(shown, f"HTTP {resp.status} without a Location")
                return None, location
            if not 200 <= resp.status < 300:
                raise self._failed(shown, f"the server answered HTTP {resp.status}")
            what = f"the image at {shown}"
            declared = resp.content_length
            if declared is not None and declared > self.policy.max_image_bytes:
                raise self.policy.too_many_bytes(what, declared)
            body = bytearray()
            async for chunk in resp.content.iter_chunked(_CHUNK_LEN):
                body += chunk
                if len(body) > self.policy.max_image_bytes:
                    raise self.policy.too_many_bytes(what)
            return bytes(body), ""

    @staticmethod
    def _failed(shown: str, why: str) -> MediaError:
        return MediaError(f"image_url: fetching {shown} failed: {why}", "image_fetch_failed")
