"""An abort storm against one real server (tiny model, 8 running slots, a small KV pool), and a
SIGTERM drain against another (a pool for one request of nearly its whole context).

The storm: STORM_REQUESTS requests from STORM_CLIENTS concurrent clients, each randomly run to
the end, disconnected (streaming or not), aborted through /abort_request, or given a tiny
per-request timeout; single prompts, n=2 and batches. Afterwards no process holds any state, the
KV invariant holds, no output went to an unknown rid, the same greedy request gives the same
text as before, and the scheduler's RSS grew by less than RSS_GROWTH_BOUND. The storm fills the
radix cache, and the scheduler's RSS grows with it until the pool is full, then stays (about
4 KiB a cached token, measured on CPU): the storm's pool stays small, so the bound sees leaks.

The drain: a short and a long request are queued while generation is paused, so both are in
flight at the SIGTERM by construction; the drain continues generation itself. The short one (a few
tokens) finishes within the drain; the long one (ignore_eos, nearly the whole context of
CONTEXT_LEN positions, far more than the drain leaves time for) is aborted with "shutdown".
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.live_server import (
    LiveServer,
    assert_no_state_left,
    long_context_tiny_llama,
    metric,
    running_server,
    set_paused,
)

STORM_REQUESTS, STORM_CLIENTS, STORM_DEADLINE_S = 600, 32, 90
RSS_GROWTH_BOUND = 64 * 2**20
SHUTDOWN_TIMEOUT = 5.0  # the short request needs a few steps of it
CONTEXT_LEN = 131072  # the long request's tokens: 13 s of decoding even at 0.1 ms a token
GREEDY = {"text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 24}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("storm_e2e")
    model = long_context_tiny_llama(tmp / "model", smollm2_hf_dir)
    args = ["--max-total-tokens", "3072", "--chunked-prefill-size", "64",
            "--max-running-requests", "8", "--log-level", "info", "--dtype", "float32"]  # fmt: skip
    # float32: greedy output after the storm is compared with the same request before it
    with running_server(model, args, tmp / "server.log") as srv:
        yield srv


@pytest.fixture
def draining_server(
    tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str
) -> Iterator[LiveServer]:
    """Its test ends it (SIGTERM)."""
    tmp = tmp_path_factory.mktemp("drain_e2e")
    model = long_context_tiny_llama(tmp / "model", smollm2_hf_dir, CONTEXT_LEN)
    # the pool holds the long request next to the short one
    args = ["--max-total-tokens", str(CONTEXT_LEN + 1024), "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT), "--log-level", "info"]  # fmt: skip
    with running_server(model, args, tmp / "server.log") as srv:
        yield srv


def _body(rng: random.Random, rid: str, stream: bool) -> tuple[str, dict[str, Any]]:
    params = {"max_new_tokens": rng.randint(1, 48), "ignore_eos": rng.random() < 0.5}
    shape = rng.random()
    if shape < 0.15:
        params["n"] = 2
    if shape > 0.85:
        prompts = [f"batch {rid} {i} " * rng.randint(1, 30) for i in range(2)]
        return "/generate", {"text": prompts, "sampling_params": params, "stream": stream,
                             "rid": [f"{rid}-a", f"{rid}-b"]}  # fmt: skip
    if rng.random() < 0.5:
        body = {"prompt": f"storm {rid} " * rng.randint(1, 60), "stream": stream, "rid": rid,
                "max_tokens": params["max_new_tokens"], "n": params.get("n", 1)}  # fmt: skip
        return "/v1/completions", body
    return "/generate", {"text": f"storm {rid} " * rng.randint(1, 60), "sampling_params": params,
                         "stream": stream, "rid": rid}  # fmt: skip


async def _one(client: httpx.AsyncClient, rng: random.Random, rid: str, tally: dict) -> None:
    action = rng.choice(["finish", "disconnect", "abort", "timeout"])
    stream = rng.random() < 0.5
    path, body = _body(rng, rid, stream)
    if action == "timeout":
        body["timeout"] = rng.uniform(0.005, 0.1)

    async def call() -> None:
        if stream:
            async with client.stream("POST", path, json=body) as resp:
                async for _ in resp.aiter_lines():
                    pass
        else:
            await client.post(path, json=body)

    task = asyncio.create_task(call())
    if action in ("disconnect", "abort"):
        await asyncio.sleep(rng.uniform(0, 0.05))
        if action == "abort":
            await client.post("/abort_request", json={"rid": rid})
        else:
            task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    tally[action] += 1


async def _storm(base: str) -> dict[str, int]:
    rng = random.Random(7)
    tally = dict.fromkeys(["finish", "disconnect", "abort", "timeout"], 0)
    queue = list(range(STORM_REQUESTS))
    limits = httpx.Limits(max_connections=STORM_CLIENTS * 2)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                await _one(client, random.Random(rng.random()), f"s{i}", tally)

        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(STORM_CLIENTS))), STORM_DEADLINE_S
        )
    return tally


def test_abort_storm_leaves_nothing_behind(server: LiveServer) -> None:
    before = httpx.post(f"{server.base}/generate", json=GREEDY, timeout=30).json()["text"]
    scheduler = server.child("sluice::scheduler")
    rss_before = scheduler.memory_info().rss
    started = time.monotonic()
    tally = asyncio.run(_storm(server.base))
    took = time.monotonic() - started
    assert_no_state_left(server.wait_idle(timeout=20))
    rss_after = scheduler.memory_info().rss
    print(
        f"storm: {STORM_REQUESTS} requests {tally} over {STORM_CLIENTS} clients in {took:.1f} s; "
        f"scheduler RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
    assert min(tally.values()) > 50, tally
    assert rss_after - rss_before < RSS_GROWTH_BOUND
    page = server.metrics()
    assert metric(page, "sluice_unknown_rid_outputs_total") == 0
    assert metric(page, 'sluice_request_aborts_total{cause="client_disconnect"}') > 0
    assert metric(page, 'sluice_request_aborts_total{cause="timeout"}') > 0
    assert httpx.get(f"{server.base}/health_generate").status_code == 200
    after = httpx.post(f"{server.base}/generate", json=GREEDY, timeout=30).json()["text"]
    assert after == before


async def _events(client: httpx.AsyncClient, body: dict[str, Any], out: list[Any]) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))


def _both_queued(state: dict[str, Any]) -> bool:
    return state["paused"] and state["num_waiting_reqs"] == 2


def test_sigterm_drains_then_aborts_then_exits_zero(draining_server: LiveServer) -> None:
    server = draining_server

    async def go() -> tuple[list[Any], list[Any]]:
        short: list[Any] = []
        long: list[Any] = []
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            base = {"prompt": "drain", "ignore_eos": True, "temperature": 0, "stream": True}
            await set_paused(client, True)
            try:
                tasks = [
                    asyncio.create_task(_events(client, {**base, "max_tokens": 20}, short)),
                    asyncio.create_task(
                        _events(client, {**base, "max_tokens": CONTEXT_LEN - 64}, long)
                    ),
                ]
                await asyncio.to_thread(server.wait_for, _both_queued, 30)
                server.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while (await client.get("/health_generate")).status_code == 200:
                    assert time.monotonic() < deadline, "still ready after the SIGTERM"
                    await asyncio.sleep(0.01)
                assert (await client.get("/health_generate")).status_code == 503
                assert (await client.get("/health")).status_code == 200
                refused = await client.post(
                    "/v1/completions", json={"prompt": "x", "max_tokens": 1}
                )
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "shutting_down"
            except BaseException:
                await set_paused(client, False)
                raise
            await asyncio.gather(*tasks)  # the drain itself continued the paused server
        return short, long

    signalled = time.monotonic()
    short, long = asyncio.run(go())
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == "shutdown"
    assert server.proc.wait(15) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT + 10
    log = server.log.read_text()
    assert "scheduler process exited with code 0" in log
    assert "detokenizer process exited with code 0" in log
