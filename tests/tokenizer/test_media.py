"""Image input: fetch policy, limits and decoding, against a real HTTP server on loopback.

The server runs in the test's own event loop (aiohttp.web); loopback is reached with
`allow_private=True`, set per test. Names under `.test` resolve through an injected resolver, so
no test needs DNS. A response that must not finish waits on an asyncio.Event nobody sets.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import ipaddress
import os
import signal
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from sluice.config import ServerArgs, args_from_namespace, build_parser
from sluice.server.errors import error_response
from sluice.tokenizer.media import DecodedImage, ImageCache, MediaError, MediaManager, MediaPolicy
from sluice.tokenizer.media.fetch import system_resolve
from sluice.tokenizer.media.policy import address_refusal, is_domain_allowed

pytestmark = pytest.mark.timeout(60)

EXECUTOR = ThreadPoolExecutor(2, thread_name_prefix="test-decode")


def image_bytes(fmt: str, size: tuple[int, int] = (4, 3), color: Any = (200, 10, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (5, 2), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header claims width x height RGB pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class ImageServer:
    """Routes: /img/<name> (from `files`), /big (declared length), /stream (no length, endless
    until the client leaves), /hang (never answers), /redirect?to=URL, /loop (to itself)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {
            "red.png": image_bytes("PNG"),
            "red.jpg": image_bytes("JPEG"),
            "red.webp": image_bytes("WEBP"),
            "red.bmp": image_bytes("BMP"),
            "anim.gif": animated_gif(),
            "red.tiff": image_bytes("TIFF"),
            "garbage.png": b"this is not an image at all " * 10,
            "truncated.png": image_bytes("PNG", (64, 64), (1, 2, 3))[:60],
            "bomb.png": png_declaring(9000, 9000),
            "mega-bomb.png": png_declaring(100_000, 100_000),
        }
        self.hang_entered = asyncio.Event()
        self.hang_left = asyncio.Event()
        self.never = asyncio.Event()  # nobody sets it
        self.hosts_seen: list[str] = []
        self.base = ""

    async def img(self, request: web.Request) -> web.Response:
        self.hosts_seen.append(request.host)
        name = request.match_info["name"]
        if name not in self.files:
            return web.Response(status=404)
        return web.Response(body=self.files[name], content_type="image/png")

    async def big(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(50 * 1024 * 1024)})
        await resp.prepare(request)
        await resp.write(b"\x00" * 1024)
        await self.never.wait()
        return resp

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # chunked: no Content-Length to trust
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(10_000):
                await resp.write(b"\x89" * 4096)
        return resp

    async def hang(self, request: web.Request) -> web.Response:
        self.hang_entered.set()
        try:
            await self.never.wait()
        finally:
            self.hang_left.set()
        return web.Response()

    async def redirect(self, request: web.Request) -> web.Response:
        # Connection: close, so the next hop opens (and resolves) a new connection
        headers = {"Location": request.query["to"], "Connection": "close"}
        return web.Response(status=302, headers=headers)

    async def loop(self, request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "/loop"})


@contextlib.asynccontextmanager
async def image_server() -> AsyncIterator[ImageServer]:
    srv = ImageServer()
    app = web.Application()
    app.router.add_get("/img/{name}", srv.img)
    for path in ("big", "stream", "hang", "redirect", "loop"):
        app.router.add_get(f"/{path}", getattr(srv, path))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    srv.port = runner.addresses[0][1]
    srv.base = f"http://127.0.0.1:{srv.port}"
    try:
        yield srv
    finally:
        await runner.cleanup()


def fake_dns(table: dict[str, list[str]]) -> Callable[[str, int], Any]:
    """A resolver from a table; `calls` records each lookup. A list of lists answers in turn."""

    async def resolve(host: str, port: int) -> list[str]:
        resolve.calls.append(host)  # type: ignore[attr-defined]
        answers = table[host]
        if answers and isinstance(answers[0], list):
            return answers.pop(0) if len(answers) > 1 else answers[0]
        return answers

    resolve.calls = []  # type: ignore[attr-defined]
    return resolve


@contextlib.asynccontextmanager
async def media(
    resolve: Callable[[str, int], Any] = system_resolve, cache_bytes: int = 1 << 20, **policy: Any
) -> AsyncIterator[MediaManager]:
    policy.setdefault("allow_private", True)
    manager = MediaManager(
        MediaPolicy(**policy), cache_bytes=cache_bytes, executor=EXECUTOR, resolve=resolve
    )
    try:
        yield manager
    finally:
        await manager.close()


async def refusal(manager: MediaManager, url: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        await manager.load_image(url)
    return info.value


# ---- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["red.png", "red.jpg", "red.webp", "red.bmp"])
def test_supported_formats_decode_to_rgb_with_their_hash(name: str) -> None:
    async def main() -> None:
        async with image_server() as srv, media() as m:
            image = await m.load_image(f"{srv.base}/img/{name}")
            assert image.pixels.shape == (3, 4, 3) and image.pixels.dtype.name == "uint8"
            assert (image.width, image.height) == (4, 3)
            assert image.hash == hashlib.sha256(srv.files[name]).hexdigest()
            red, green, _ = (int(v) for v in image.pixels[1, 1])
            assert red > 150 and green < 60  # lossy formats stay near (200, 10, 30)

    run(main())


def test_animated_gif_gives_its_first_frame() -> None:
    async def main() -> None:
        async with image_server() as srv, media() as m:
            image = await m.load_image(f"{srv.base}/img/anim.gif")
            assert image.format == "GIF" and image.pixels.shape == (2, 5, 3)
            assert tuple(image.pixels[0, 0]) == (255, 0, 0)

    run(main())


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("garbage.png", "image_url: the data is not an image in a supported format (JPEG, PNG"),
        ("red.tiff", "not an image in a supported format"),
        ("truncated.png", "image_url: the PNG image cannot be decoded"),
        ("bomb.png", "image_url: the image is 9000x9000 = 81.0 Mpixels, over the limit of "
         "25.0 Mpixels (--max-image-pixels)"),
        ("mega-bomb.png", "image_url: the image is 10000.0 Mpixels, over the limit of 25.0"),
    ],
)  # fmt: skip
def test_undecodable_unsupported_and_bomb_images_are_refused(name: str, message: str) -> None:
    async def main() -> None:
        async with image_server() as srv, media() as m:
            err = await refusal(m, f"{srv.base}/img/{name}")
            assert message in err.message
            assert err.status_code == 400 and err.param == "image_url"
            assert len(m.cache) == 0

    run(main())


def test_pixel_limit_is_checked_from_the_header_before_decoding() -> None:
    # 10 Gpixels declared in a ~60-byte file: refused without allocating them
    data = png_declaring(100_000, 100_000)
    assert len(data) < 100

    async def main() -> None:
        async with media(max_image_pixels=11) as m:
            ok = await m.load_image(data_uri(image_bytes("PNG", (3, 3))))
            assert ok.pixels.shape == (3, 3, 3)
            err = await refusal(m, data_uri(image_bytes("PNG", (4, 3))))
            assert "the image is 4x3 = 12 pixels, over the limit of 11 pixels" in err.message
            err = await refusal(m, data_uri(data))
            assert "the image is 10000.0 Mpixels, over the limit of 11 pixels" in err.message

    run(main())


# ---- data: URIs -------------------------------------------------------------------------------


def test_data_uris() -> None:
    png = image_bytes("PNG")

    async def main() -> None:
        async with media(max_image_bytes=4096) as m:
            image = await m.load_image(data_uri(png))
            assert image.hash == hashlib.sha256(png).hexdigest()
            unpadded = data_uri(png).rstrip("=")
            assert (await m.load_image(unpadded)).hash == image.hash
        async with media() as m:  # past 1 MiB, base64 and the hash run in a thread
            noise = np.random.default_rng(0).integers(0, 256, (700, 700, 3), np.uint8)
            buf = io.BytesIO()
            Image.fromarray(noise).save(buf, format="PNG")
            assert buf.tell() > 1024 * 1024
            big = await m.load_image(data_uri(buf.getvalue()))
            assert big.hash == hashlib.sha256(buf.getvalue()).hexdigest()
            assert np.array_equal(big.pixels, noise)
        async with media(max_image_bytes=4096) as m:
            cases = {
                "data:image/png,abc": "only base64 data: URIs are accepted",
                "data:image/png;base64": "needs a comma",
                "data:text/html;base64,PGI+": "the data: URI is of type text/html, not an image",
                "data:image/png;base64,!!!!": "not valid base64",
                data_uri(b"x" * 5000): "image_url: the image in the data: URI is 5000 bytes, "
                "over the limit of 4096 bytes per image (--max-image-bytes)",
                data_uri(b"not an image"): "not an image in a supported format",
            }
            for url, message in cases.items():
                assert message in (await refusal(m, url)).message, url

    run(main())


# ---- schemes and local files ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://example.com/a.png", "the URL scheme 'ftp' is not supported"),
        ("gopher://example.com/", "the URL scheme 'gopher' is not supported"),
        ("javascript:alert(1)", "the URL scheme 'javascript' is not supported"),
        ("/etc/passwd", "'/etc/passwd' (not a URL) is not supported"),
        ("file:///etc/passwd", "local files are refused (the server was not started with "
         "--allowed-local-media-path)"),
        ("http:///nohost.png", "has no host"),
    ],
)  # fmt: skip
def test_other_schemes_are_refused(url: str, message: str) -> None:
    async def main() -> None:
        async with media() as m:
            assert message in (await refusal(m, url)).message

    run(main())


def test_local_files_only_inside_the_allowed_directory(tmp_path: Any) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(image_bytes("PNG"))
    (allowed / "big.png").write_bytes(b"\0" * 5000)
    (outside / "secret.png").write_bytes(image_bytes("PNG"))
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "sub").mkdir()

    async def main() -> None:
        async with media(allowed_local_path=str(allowed), max_image_bytes=4096) as m:
            image = await m.load_image(f"file://{allowed}/ok.png")
            assert image.pixels.shape == (3, 4, 3)
            escapes = [
                f"file://{outside}/secret.png",
                f"file://{allowed}/../outside/secret.png",
                f"file://{allowed}/%2e%2e/outside/secret.png",
                f"file://{allowed}/link.png",
            ]
            for url in escapes:
                err = await refusal(m, url)
                assert "is outside the directory allowed by --allowed-local-media-path" in (
                    err.message
                ), url
                assert str(outside) not in err.message or url.startswith(f"file://{outside}")
            err = await refusal(m, f"file://{allowed}/big.png")
            assert "is 5000 bytes, over the limit of 4096 bytes" in err.message
            assert "is not a regular file" in (await refusal(m, f"file://{allowed}/sub")).message
            assert "cannot open" in (await refusal(m, f"file://{allowed}/missing.png")).message
            assert (
                "names no host" in (await refusal(m, f"file://evil.test{allowed}/ok.png")).message
            )

    run(main())


# ---- addresses and domains ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "private_ok", "reason"),
    [
        ("8.8.8.8", False, None),
        ("2606:4700::1111", False, None),
        ("127.0.0.1", False, "a loopback address"),
        ("127.0.0.1", True, None),
        ("10.1.2.3", False, "a private address"),
        ("172.31.0.1", False, "a private address"),
        ("192.168.1.1", True, None),
        ("100.64.0.1", False, "a carrier-grade NAT address"),
        ("169.254.169.254", True, "the cloud metadata address"),
        ("169.254.1.1", True, "a link-local address"),
        ("100.100.100.200", True, "a cloud metadata address"),
        ("fd00:ec2::254", True, "a cloud metadata address"),
        ("0.0.0.0", True, "an unspecified address"),
        ("::", True, "an unspecified address"),
        ("224.0.0.1", True, "a multicast address"),
        ("ff02::1", True, "a multicast address"),
        ("255.255.255.255", True, "a reserved address"),
        ("240.0.0.1", True, "a reserved address"),
        ("192.0.2.1", True, "a reserved address"),
        ("::1", False, "a loopback address"),
        ("fc00::1", False, "a private address"),
        ("fd12:3456::1", False, "a private address"),
        ("fe80::1", True, "a link-local address"),
        ("fe80::1%eth0", True, "a link-local address"),
        ("::ffff:127.0.0.1", False, "a loopback address (127.0.0.1 inside IPv6)"),
        ("::ffff:169.254.169.254", True, "the cloud metadata address (169.254.169.254 inside"),
        ("::ffff:8.8.8.8", False, None),
        ("64:ff9b::a00:1", False, "a private address (10.0.0.1 inside IPv6)"),
        ("2002:a9fe:a9fe::1", True, "the cloud metadata address (169.254.169.254 inside"),
        ("2001::1", True, "a Teredo address"),
        ("2001:db8::1", True, "a reserved address"),
        ("::1.2.3.4", True, "a reserved address"),  # IPv4-compatible, deprecated
    ],
)
def test_address_rule(address: str, private_ok: bool, reason: str | None) -> None:
    got = address_refusal(ipaddress.ip_address(address), allow_private=private_ok)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason)


def test_domain_allowlist_takes_subdomains_not_lookalikes() -> None:
    allowed = MediaPolicy(allowed_domains=("Example.COM.", "*.cdn.org")).allowed_domains
    assert allowed == ("example.com", "cdn.org")
    for host in ("example.com", "img.example.com", "EXAMPLE.com.", "a.b.cdn.org"):
        assert is_domain_allowed(host, allowed), host
    for host in ("badexample.com", "example.com.evil.test", "org", "cdn.org.evil"):
        assert not is_domain_allowed(host, allowed), host
    assert is_domain_allowed("anything.test", ())


def test_loopback_and_private_hosts_are_refused_unless_allowed() -> None:
    dns = fake_dns(
        {
            "localhost": ["127.0.0.1", "::1"],
            "intranet.test": ["10.0.0.7"],
            "mixed.test": ["8.8.8.8", "192.168.0.9"],
        }
    )

    async def main() -> None:
        async with image_server() as srv, media(resolve=dns, allow_private=False) as m:
            err = await refusal(m, f"{srv.base}/img/red.png")
            assert err.code == "image_url_refused"
            assert (
                f"image_url: refused to fetch {srv.base}/img/red.png: 127.0.0.1 is a loopback "
                "address (--allow-private-media-urls" in err.message
            )
            err = await refusal(m, f"http://localhost:{srv.port}/img/red.png")
            assert "localhost resolves to" in err.message and "loopback" in err.message
            err = await refusal(m, "http://intranet.test/x.png")
            assert "intranet.test resolves to 10.0.0.7, a private address" in err.message
            # every address counts: one private answer refuses the host
            err = await refusal(m, "http://mixed.test/x.png")
            assert "mixed.test resolves to 192.168.0.9, a private address" in err.message
            err = await refusal(m, "http://[::ffff:127.0.0.1]/x.png")
            assert "a loopback address (127.0.0.1 inside IPv6)" in err.message
            assert srv.hosts_seen == []  # nothing reached the server

    run(main())


def test_the_connection_goes_to_the_checked_address_and_each_hop_is_checked_again() -> None:
    # images.test answers loopback first, then the metadata address (a rebinding attack)
    dns = fake_dns({"images.test": [["127.0.0.1"], ["169.254.169.254"]]})

    async def main() -> None:
        async with image_server() as srv, media(resolve=dns) as m:
            url = f"http://images.test:{srv.port}/img/red.png"
            image = await m.load_image(url)  # no real DNS knows images.test
            assert image.hash == hashlib.sha256(srv.files["red.png"]).hexdigest()
            assert srv.hosts_seen == [f"images.test:{srv.port}"] and dns.calls == ["images.test"]
            hop = f"http://images.test:{srv.port}/redirect?to=/img/red.png"
            err = await refusal(m, hop)
            assert "images.test resolves to 169.254.169.254, the cloud metadata" in err.message
            assert len(srv.hosts_seen) == 1  # the image was not fetched again

    run(main())


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is the cloud metadata"),
        ("http://[::ffff:a9fe:a9fe]/", "the cloud metadata address (169.254.169.254 inside IPv6)"),
        ("http://metadata.test/", "metadata.test resolves to 169.254.169.254"),
        ("http://0.0.0.0:1/", "0.0.0.0 is an unspecified address"),
        ("file:///etc/passwd", "only http and https are fetched"),
        ("ftp://example.com/a.png", "only http and https are fetched"),
        ("http://evil.test/a.png", "the host evil.test is not in --allowed-media-domains"),
    ],
)
def test_redirects_to_refused_targets_are_refused(target: str, message: str) -> None:
    dns = fake_dns({"metadata.test": ["169.254.169.254"], "evil.test": ["127.0.0.1"]})

    async def main() -> None:
        domains = ("127.0.0.1", "metadata.test", "169.254.169.254", "0.0.0.0", "example.com")
        async with image_server() as srv, media(resolve=dns, allowed_domains=domains) as m:
            url = f"{srv.base}/redirect?to={target}"
            err = await refusal(m, url)
            assert err.code == "image_url_refused"
            assert f"image_url: refused to fetch {url} (redirected to" in err.message
            assert message in err.message

    run(main())


def test_domain_allowlist_on_fetch() -> None:
    names = ("images.test", "cdn.images.test", "badimages.test", "evil.test")
    dns = fake_dns({name: ["127.0.0.1"] for name in names})

    async def main() -> None:
        async with image_server() as srv, media(resolve=dns, allowed_domains=("images.test",)) as m:
            for host in ("images.test", "cdn.images.test"):
                await m.load_image(f"http://{host}:{srv.port}/img/red.png")
            for host in ("badimages.test", "evil.test", "127.0.0.1"):
                err = await refusal(m, f"http://{host}:{srv.port}/img/red.png")
                assert f"the host {host} is not in --allowed-media-domains" in err.message
            assert dns.calls == ["images.test", "cdn.images.test"]  # refused before any lookup

    run(main())


# ---- limits -----------------------------------------------------------------------------------


def test_byte_limit_stops_reading_whatever_the_length_says() -> None:
    async def main() -> None:
        async with image_server() as srv, media(max_image_bytes=10_000) as m:
            err = await refusal(m, f"{srv.base}/stream")  # chunked: no length given
            assert (
                f"image_url: the image at {srv.base}/stream is more than 10000 bytes, over the "
                "limit of 10000 bytes per image (--max-image-bytes)" in err.message
            )
            err = await refusal(m, f"{srv.base}/big")  # refused on its declared length
            assert "is 50.0 MiB, over the limit of 10000 bytes" in err.message
            assert err.code == "image_too_large"
            ok = await m.load_image(f"{srv.base}/img/red.png")  # the server still answers
            assert ok.width == 4

    run(main())


def test_a_fetch_that_never_answers_times_out() -> None:
    async def main() -> None:
        async with image_server() as srv, media(fetch_timeout=0.2) as m:
            err = await refusal(m, f"{srv.base}/hang")
            assert srv.hang_entered.is_set()
            assert f"fetching {srv.base}/hang took longer than 0.2 s (--media-fetch-timeout)" in (
                err.message
            )
            assert err.code == "image_fetch_failed"
            await asyncio.wait_for(srv.hang_left.wait(), 10)  # the connection was closed

    run(main())


def test_redirects_are_bounded_and_http_errors_are_refusals() -> None:
    async def main() -> None:
        async with image_server() as srv, media(max_redirects=3) as m:
            err = await refusal(m, f"{srv.base}/loop")
            assert f"image_url: {srv.base}/loop redirects more than 3 times" in err.message
            image = await m.load_image(f"{srv.base}/redirect?to=/img/red.png")
            assert image.width == 4
            err = await refusal(m, f"{srv.base}/img/missing.png")
            assert "failed: the server answered HTTP 404" in err.message
            err = await refusal(m, "http://127.0.0.1:1/x.png")  # nothing listens there
            assert "image_url: fetching http://127.0.0.1:1/x.png failed" in err.message

    run(main())


def test_images_per_request_are_counted_before_any_fetch() -> None:
    async def main() -> None:
        async with image_server() as srv, media(max_images=2) as m:
            urls = [f"{srv.base}/img/red.png"] * 3
            with pytest.raises(MediaError) as info:
                await m.load_images(urls)
            assert info.value.message == (
                "the request has 3 images, over the limit of 2 per request "
                "(--max-images-per-request)"
            )
            assert info.value.code == "too_many_images" and srv.hosts_seen == []
            images = await m.load_images(urls[:2])
            assert [i.width for i in images] == [4, 4]

    run(main())


# ---- cancellation ---------------------------------------------------------------------------


def test_cancelling_a_fetch_closes_it_and_leaves_no_task() -> None:
    async def main() -> None:
        async with image_server() as srv, media() as m:
            await m.load_image(f"{srv.base}/img/red.png")  # the session exists before
            before = asyncio.all_tasks()
            task = asyncio.create_task(m.load_image(f"{srv.base}/hang"))
            await asyncio.wait_for(srv.hang_entered.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(srv.hang_left.wait(), 10)  # the server saw the client leave
            await asyncio.sleep(0)
            assert asyncio.all_tasks() <= before

    run(main())


def test_one_refused_image_cancels_the_others_of_its_request() -> None:
    async def main() -> None:
        async with image_server() as srv:

            async def resolve(host: str, port: int) -> list[str]:
                await srv.hang_entered.wait()  # refused only once the other fetch is in flight
                return ["169.254.169.254"]

            async with media(resolve=resolve) as m:
                urls = [f"{srv.base}/hang", "http://metadata.test/a.png"]
                with pytest.raises(MediaError, match="resolves to 169.254.169.254"):
                    await m.load_images(urls)
                await asyncio.wait_for(srv.hang_left.wait(), 10)  # the other fetch was closed

    run(main())


# ---- cache and pool ---------------------------------------------------------------------------


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.num_submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.num_submitted += 1
        return super().submit(*args, **kwargs)


def test_images_are_cached_by_content_hash() -> None:
    executor = CountingExecutor()
    png = image_bytes("PNG")

    async def main() -> None:
        async with image_server() as srv:
            srv.files["copy.png"] = png
            m = MediaManager(MediaPolicy(allow_private=True), executor=executor)
            try:
                first = await m.load_image(data_uri(png))
                again = await m.load_image(f"{srv.base}/img/copy.png")  # same bytes, other URL
                assert again is first and executor.num_submitted == 1
                other = await m.load_image(f"{srv.base}/img/red.jpg")
                assert other.hash != first.hash and executor.num_submitted == 2
            finally:
                await m.close()
        assert not executor._shutdown  # a passed-in executor is the caller's to shut down

    run(main())
    executor.shutdown()


def test_a_repeated_data_uri_is_neither_decoded_nor_hashed_again() -> None:
    executor = CountingExecutor()
    png, jpeg = image_bytes("PNG"), image_bytes("JPEG", color=(1, 2, 3))

    async def main() -> None:
        m = MediaManager(MediaPolicy(), cache_bytes=100, executor=executor)  # 36 B an image
        try:
            first = await m.load_image(data_uri(png))
            assert (m.num_fetched, executor.num_submitted) == (1, 1)
            again = await m.load_image(data_uri(png))  # the same text: no base64, no worker
            assert again is first and (m.num_fetched, executor.num_submitted) == (1, 1)
            unpadded = await m.load_image(data_uri(png).rstrip("="))  # other text, same bytes
            assert unpadded is first and (m.num_fetched, executor.num_submitted) == (2, 1)
            other = await m.load_image(data_uri(jpeg))
            assert other.hash == hashlib.sha256(jpeg).hexdigest() != first.hash
            assert (m.num_fetched, executor.num_submitted) == (3, 2)
            for color in range(3):  # the cache holds 2 images: png's is evicted
                await m.load_image(data_uri(image_bytes("PNG", color=(color, 0, 0))))
            evicted = await m.load_image(data_uri(png))  # known text, image gone: decoded again
            assert evicted.hash == first.hash and executor.num_submitted == 6
            assert m.num_fetched == 7
        finally:
            await m.close()

    run(main())
    executor.shutdown()


def test_remembered_data_uris_are_bounded() -> None:
    pngs = [image_bytes("PNG", color=(c, 0, 0)) for c in range(3)]

    async def main() -> None:
        m = MediaManager(MediaPolicy(), executor=EXECUTOR, max_uri_keys=2)
        try:
            for png in pngs:
                await m.load_image(data_uri(png))
            assert len(m.uri_hashes) == 2  # the first one's text is forgotten
            await m.load_image(data_uri(pngs[0]))  # decoded (and hashed) again
            assert m.num_fetched == 4 and len(m.cache) == 3
        finally:
            await m.close()

    run(main())


def test_image_cache_is_bounded_by_bytes_lru_first() -> None:
    def img(name: str, side: int) -> DecodedImage:
        return DecodedImage(name, "PNG", np.zeros((side, side, 3), np.uint8))

    cache = ImageCache(capacity=300)  # bytes of pixels: a 5x5 image holds 75
    for name in "abcd":
        cache.put(img(name, 5))
    assert len(cache) == 4 and cache.held_len == 300
    assert cache.get("a") is not None  # a is now the most recent
    cache.put(img("e", 5))
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 4
    cache.put(img("huge", 20))  # 1200 bytes: larger than the whole cache, not kept
    assert cache.get("huge") is None and cache.held_len == 300
    empty = ImageCache(capacity=0)
    empty.put(img("a", 1))
    assert len(empty) == 0


def test_decoding_runs_in_a_process_pool_started_by_the_first_image() -> None:
    async def main() -> None:
        m = MediaManager(MediaPolicy(), num_workers=1)
        try:
            assert not m.is_pool_started  # text-only traffic never starts it
            image = await m.load_image(data_uri(image_bytes("PNG")))
            assert m.is_pool_started and image.pixels.shape == (3, 4, 3)
            # the refusal crosses the process boundary with its message and code
            err = await refusal(m, data_uri(png_declaring(9000, 9000)))
            assert "9000x9000 = 81.0 Mpixels" in err.message and err.code == "image_too_large"
            pool = m._executor
            assert isinstance(pool, ProcessPoolExecutor)
            # a worker that dies (a decoder crash, the OOM killer) fails its image, not the next
            for pid in list(pool._processes):
                os.kill(pid, signal.SIGKILL)
            err = await refusal(m, data_uri(image_bytes("PNG", (2, 2))))
            assert "could not be decoded (the decoder died)" in err.message
            again = await m.load_image(data_uri(image_bytes("PNG", (2, 2))))
            assert again.pixels.shape == (2, 2, 3) and m._executor is not pool
        finally:
            await m.close()
        assert not m.is_pool_started

    run(main())


_ABANDONING_OWNER = """
import asyncio, base64, io, os
from PIL import Image
from sluice.tokenizer.media import MediaManager, MediaPolicy

async def main():
    m = MediaManager(MediaPolicy(), num_workers=1)
    buf = io.BytesIO()
    Image.new("RGB", (3, 4)).save(buf, format="PNG")
    await m.load_image("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    print(" ".join(str(pid) for pid in m._executor._processes), flush=True)

asyncio.run(main())
os._exit(0)  # as a stop signal ends an HTTP process: no close, no atexit
"""


def test_the_pool_goes_with_its_owner_however_it_ends() -> None:
    """The owner exits without closing the pool: its processes exit within seconds (they
    watch their parent) instead of waiting for work forever."""
    import subprocess
    import sys

    import psutil

    out = subprocess.run(
        [sys.executable, "-c", _ABANDONING_OWNER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert pids  # the pool starts a process per image in flight, up to its size
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=20)
    for proc in alive:  # leave nothing behind even when failing
        proc.kill()
    assert not alive


# ---- errors and configuration -----------------------------------------------------------------


def test_a_refusal_is_an_openai_shaped_400() -> None:
    resp = error_response(MediaError("image_url: the image is 9000x9000", "image_too_large"))
    assert resp.status_code == 400
    assert resp.body == (
        b'{"error":{"message":"image_url: the image is 9000x9000","type":"invalid_request_error",'
        b'"param":"image_url","code":"image_too_large"}}'
    )


def test_flags_build_the_policy(tmp_path: Any) -> None:
    argv = [
        "--allowed-media-domains", "example.com", "CDN.example.org",
        "--allowed-local-media-path", str(tmp_path),
        "--allow-private-media-urls",
        "--media-fetch-timeout", "2.5",
        "--max-image-bytes", "1000",
        "--max-image-pixels", "4000",
        "--max-images-per-request", "3",
        "--max-image-tiles-per-request", "5",
        "--max-media-redirects", "1",
        "--media-cache-mb", "8",
        "--num-media-workers", "2",
    ]  # fmt: skip
    args = args_from_namespace(build_parser().parse_args(argv))
    assert args.allowed_media_domains == ("example.com", "CDN.example.org")
    policy = MediaPolicy.from_args(args)
    assert policy == MediaPolicy(
        allowed_domains=("example.com", "cdn.example.org"),
        allowed_local_path=os.path.realpath(tmp_path),
        allow_private=True,
        fetch_timeout=2.5,
        max_redirects=1,
        max_image_bytes=1000,
        max_image_pixels=4000,
        max_images=3,
        max_tiles=5,
    )
    manager = MediaManager.from_args(args)
    assert manager.cache.capacity == 8 * 1024 * 1024 and not manager.is_pool_started
    defaults = MediaPolicy.from_args(ServerArgs())
    assert defaults == MediaPolicy() and defaults.allowed_local_path is None
    assert not defaults.allow_private and defaults.max_image_pixels == 25_000_000
    assert ServerArgs(allowed_media_domains="a.com, b.com").allowed_media_domains == (
        "a.com",
        "b.com",
    )
    with pytest.raises(ValueError, match="must be more than 0"):
        ServerArgs(media_fetch_timeout=0)
    with pytest.raises(ValueError, match="is not a directory"):
        MediaPolicy(allowed_local_path=str(tmp_path / "missing"))
