"""serving.py's streaming client against a real HTTP server (aiohttp's, on a free port) that
writes its server-sent events in awkward pieces: an event split over writes, several events in
one write, a comment line, CRLF line ends, and a chunk after [DONE] that must not be read."""

from __future__ import annotations

import asyncio
import json
import socket
from types import ModuleType

import pytest
from aiohttp import web

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def serving() -> ModuleType:
    return load_benchmark("serving")


def _event(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    body: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        body = {"choices": [], "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


PIECES = [
    _event("Hel")[:9],  # an event cut inside its JSON ...
    _event("Hel")[9:] + b": keep-alive\n\n",  # ... its rest, then a comment
    _event("lo") + _event(" wor"),  # two events in one write
    _event("ld").replace(b"\n", b"\r\n"),  # CRLF line ends
    _event("", finish="length"),  # the finish: no text, no token
    _event("", usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}),
    b"data: [DONE]\n\n",
    _event("after done"),  # never read
]


async def _request(serving: ModuleType, handler, payload: dict):
    """`serving.stream_request` to a server whose one route is `handler`."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with serving.client_session() as client:
            url = f"http://127.0.0.1:{port}/v1/completions"
            return await serving.stream_request(client, url, payload)
    finally:
        await runner.cleanup()


async def _run(serving: ModuleType, pieces: list[bytes]):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.01)  # each piece its own read on the client's side
        return resp

    return await _request(serving, handler, {"prompt": [1, 2, 3]})


def test_events_are_read_whole_however_the_stream_is_cut(serving: ModuleType) -> None:
    stats = asyncio.run(_run(serving, PIECES))
    assert stats.text == "Hello world"
    assert stats.output_tokens == 4  # usage's count
    assert stats.finish_reason == "length"
    # four token events: the first gives the TTFT, the three after it a gap each (two of them
    # arrived in one read: a gap of 0)
    assert stats.ttft > 0
    assert len(stats.itls) == 3
    assert min(stats.itls) == 0.0
    assert max(stats.itls) > 0.005


def test_without_usage_the_token_events_are_counted(serving: ModuleType) -> None:
    pieces = [p for p in PIECES if b'"usage"' not in p]
    stats = asyncio.run(_run(serving, pieces))
    assert stats.output_tokens == 4
    assert stats.text == "Hello world"


def test_a_last_event_without_its_line_end_is_read(serving: ModuleType) -> None:
    # no [DONE], and the usage event cut short of its blank line as the stream closes
    pieces = [*PIECES[:5], _event("", usage={"completion_tokens": 9}).rstrip(b"\n")]
    stats = asyncio.run(_run(serving, pieces))
    assert stats.output_tokens == 9 and stats.text == "Hello world"


def test_an_error_status_raises_with_the_body(serving: ModuleType) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "nope"}}, status=400)

    with pytest.raises(RuntimeError, match="HTTP 400: .*nope"):
        asyncio.run(_request(serving, handler, {}))
