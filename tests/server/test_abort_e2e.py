"""Abort, timeouts, admission and health through the real server (all processes, tiny model).

One server with one running slot and 2-token prefill chunks, so a second request waits in the
queue and a long prompt spends thousands of steps in chunked prefill. Every test that needs work
in flight (queued, prefilling, decoding) at some moment holds it there by construction, never by
the machine being slow: it pauses generation in place (no forward step runs; aborts, disconnects
and timeouts still do) and asserts the phase on the frozen state, and its holding requests are
HOLD requests, which no decode speed finishes within the test. Each test asserts the early ends
it caused on /metrics, and after every test no process holds any state of any request and every
KV slot is free or cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from sluice.tokenizer.counters import ABORT_CAUSES, REJECT_REASONS, TIMEOUT_KINDS
from tests.server.live_server import (
    LiveServer,
    assert_no_state_left,
    is_idle,
    long_context_tiny_llama,
    metric,
    running_server,
)

# generous enough that a loaded CI machine never expires a request a test means to abort
WAITING_TIMEOUT, RUNNING_TIMEOUT, HEALTH_TIMEOUT = 2.0, 3.0, 1.5
CONTEXT_LEN = 16384  # the model's positions, and the KV pool
# HOLD: all the room the context leaves after a prompt of up to 64 tokens, greedy, no EOS. It
# ends by the test's action or by the running timeout (finishing first would take more than
# 5000 decode steps a second); a test that asserts it is in flight also pauses generation.
HOLD_TOKENS = CONTEXT_LEN - 64
HOLD = {"max_new_tokens": HOLD_TOKENS, "ignore_eos": True, "temperature": 0}
OPENAI_HOLD = {"max_tokens": HOLD_TOKENS, "ignore_eos": True, "temperature": 0}
SHORT = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
CHAT = [{"role": "user", "content": "Tell me a long story."}]


def _aborts(cause: str) -> str:
    return f'sluice_request_aborts_total{{cause="{cause}"}}'


def _timeouts(kind: str) -> str:
    return f'sluice_request_timeouts_total{{kind="{kind}"}}'


DISCONNECTS, ABORTS = _aborts("client_disconnect"), _aborts("abort_request")
QUEUE_FULL = 'sluice_rejected_requests_total{reason="queue_full"}'
COUNTERS = (
    *map(_aborts, ABORT_CAUSES), *map(_timeouts, TIMEOUT_KINDS),
    *(f'sluice_rejected_requests_total{{reason="{r}"}}' for r in REJECT_REASONS),
    "sluice_unknown_rid_outputs_total",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("abort_e2e")
    model = long_context_tiny_llama(tmp / "model", smollm2_hf_dir)
    args = ["--max-total-tokens", str(CONTEXT_LEN), "--chunked-prefill-size", "2",
            "--max-running-requests", "1", "--max-queued-requests", "3",
            "--waiting-timeout", str(WAITING_TIMEOUT), "--running-timeout", str(RUNNING_TIMEOUT),
            "--health-timeout", str(HEALTH_TIMEOUT), "--log-level", "warning"]  # fmt: skip
    with running_server(model, args, tmp / "server.log") as srv:
        yield srv


@pytest.fixture(autouse=True)
def nothing_left_behind(server: LiveServer) -> Iterator[None]:
    """Also continues generation after every test, and aborts whatever a failed test left
    running, so one failure does not leave the module's server paused or busy."""
    yield
    httpx.post(f"{server.base}/continue_generation", timeout=10)
    try:
        state = server.wait_idle()
    except AssertionError:
        httpx.post(f"{server.base}/abort_request", json={"abort_all": True}, timeout=10)
        raise
    assert_no_state_left(state)
    assert metric(server.metrics(), "sluice_unknown_rid_outputs_total") == 0  # no zombies


def _ids(n: int) -> list[int]:
    """A prompt no earlier test sent (so the radix cache cannot skip its prefill)."""
    return [random.randrange(100, 40000) for _ in range(n)]


async def _state(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/get_server_info")).json()["internal_state"]


async def _wait_for(client: httpx.AsyncClient, cond: Any, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not cond(state := await _state(client)):
        assert time.monotonic() < deadline, f"not reached: {state}"
        await asyncio.sleep(0.01)
    return state


@contextlib.asynccontextmanager
async def _paused(client: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
    """Generation paused in place for the block; yields the state once the scheduler has taken
    the pause in: from then on no request changes phase except by an abort, a disconnect or a
    timeout. Requests sent inside the block queue (they travel after the pause)."""
    try:
        resp = await client.post("/pause_generation", json={"mode": "in_place"})
        assert resp.status_code == 200 and resp.json()["num_aborted"] == 0, resp.text
        yield await _wait_for(client, lambda s: s["paused"])
    finally:
        await client.post("/continue_generation")


async def _flush(client: httpx.AsyncClient) -> None:
    """Empties the radix cache, so every used KV slot (total - free) is the test's own."""
    assert (await client.post("/flush_cache")).status_code == 200


def _used(state: dict[str, Any]) -> int:
    return state["kv_pool"]["total"] - state["kv_pool"]["free"]


async def _counts(client: httpx.AsyncClient) -> dict[str, float]:
    page = (await client.get("/metrics")).text
    return {name: metric(page, name) for name in COUNTERS}


async def _counted_since(client: httpx.AsyncClient, before: dict[str, float]) -> dict[str, float]:
    """The counters that moved since `before`, once no request is left (each early end is
    counted when its owner drops the rid)."""
    await _wait_for(client, is_idle)
    after = await _counts(client)
    return {name: after[name] - before[name] for name in COUNTERS if after[name] != before[name]}


async def _read_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], events: list[Any]
) -> None:
    """Collects the SSE events of one streamed request (until cancelled: a disconnect)."""
    async with client.stream("POST", path, json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))


async def _until(events: list[Any], n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while len(events) < n:
        assert time.monotonic() < deadline, events
        await asyncio.sleep(0.005)


async def _disconnect(task: asyncio.Task[Any]) -> None:
    task.cancel()  # closes the connection
    await asyncio.gather(task, return_exceptions=True)


def _run(go: Any) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(base_url=_BASE[0], timeout=30) as client:
            return await asyncio.wait_for(go(client), 60)

    return asyncio.run(main())


_BASE: list[str] = []


@pytest.fixture(autouse=True)
def _base(server: LiveServer) -> None:
    _BASE[:] = [server.base]


def _gen(ids: list[int], params: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": params, **kw}


# ---- disconnect in every phase ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued(stream: bool) -> None:
    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        front: list[Any] = []
        a = asyncio.create_task(_read_stream(client, "/generate", _gen(_ids(4), HOLD, stream=True), front))  # fmt: skip
        await _until(front, 1)
        async with _paused(client):
            body = _gen(_ids(4), HOLD, stream=stream)
            b = asyncio.create_task(
                _read_stream(client, "/generate", body, []) if stream else client.post("/generate", json=body)
            )  # fmt: skip
            await _wait_for(client, lambda s: s["num_waiting_reqs"] == 1)
            await _disconnect(b)
            state = await _wait_for(client, lambda s: s["num_waiting_reqs"] == 0)
            assert state["num_running_reqs"] == 1 and state["num_req_states"] == 1, state
            await _disconnect(a)
        assert await _counted_since(client, before) == {DISCONNECTS: 2}

    _run(go)


def test_disconnect_during_chunked_prefill() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        await _flush(client)
        before = await _counts(client)
        events: list[Any] = []
        prompt_len = 15000  # 7500 prefill steps of 2 tokens
        params = {**HOLD, "max_new_tokens": CONTEXT_LEN - prompt_len}
        body = _gen(_ids(prompt_len), params, stream=True)
        task = asyncio.create_task(_read_stream(client, "/generate", body, events))
        await _wait_for(client, lambda s: s["num_running_reqs"] == 1)
        async with _paused(client) as state:
            assert state["num_running_reqs"] == 1 and _used(state) < prompt_len, state
            await _disconnect(task)
            assert events == []  # no token yet: it was still prefilling
        assert await _counted_since(client, before) == {DISCONNECTS: 1}

    _run(go)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_decode(stream: bool) -> None:
    async def go(client: httpx.AsyncClient) -> None:
        await _flush(client)
        before = await _counts(client)
        events: list[Any] = []
        body = _gen(_ids(4), HOLD, stream=stream)
        if stream:
            task = asyncio.create_task(_read_stream(client, "/generate", body, events))
            await _until(events, 3)
        else:  # a slot a decoded token: past the 4 prompt slots, it is decoding
            task = asyncio.create_task(client.post("/generate", json=body))
            await _wait_for(client, lambda s: _used(s) >= 4 + 3)
        async with _paused(client) as state:
            assert state["num_running_reqs"] == 1 and _used(state) > 4, state
            await _disconnect(task)
        assert await _counted_since(client, before) == {DISCONNECTS: 1}

    _run(go)


def test_disconnect_one_of_n_and_one_prompt_of_a_batch() -> None:
    """With one running slot, sample 0 (prompt 0) decodes while the others queue: the
    disconnect ends every one of them."""

    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        events: list[Any] = []
        body = {"prompt": _ids(4), "n": 3, **OPENAI_HOLD, "stream": True}
        task = asyncio.create_task(_read_stream(client, "/v1/completions", body, events))
        await _until(events, 1)
        async with _paused(client) as state:
            assert state["num_running_reqs"] == 1 and state["num_waiting_reqs"] == 2, state
            await _disconnect(task)
        assert await _counted_since(client, before) == {DISCONNECTS: 3}

        before = await _counts(client)
        batch = {"input_ids": [_ids(4), _ids(4)], "sampling_params": HOLD, "stream": True}
        task = asyncio.create_task(_read_stream(client, "/generate", batch, events := []))
        await _until(events, 1)
        async with _paused(client) as state:
            assert state["num_running_reqs"] == 1 and state["num_waiting_reqs"] == 1, state
            await _disconnect(task)
        assert await _counted_since(client, before) == {DISCONNECTS: 2}

    _run(go)


# ---- /abort_request ---------------------------------------------------------------------------


def test_abort_one_sample_and_one_prompt_by_rid() -> None:
    """Paused, all three parts queue; part 1 is aborted there, and after the continue parts 0
    and 2 run to their length."""

    async def one(client: httpx.AsyncClient, body: dict[str, Any], rid: str) -> None:
        events: list[Any] = []
        async with _paused(client):
            task = asyncio.create_task(_read_stream(client, "/generate", body, events))
            await _wait_for(client, lambda s: s["num_waiting_reqs"] == 3)
            resp = await client.post("/abort_request", json={"rid": rid})
            assert resp.json()["num_aborted"] == 1, resp.text
        await asyncio.wait_for(task, 20)
        assert events[-1] == "[DONE]"
        last = {e["index"]: e for e in events[:-1]}
        reasons = [last[i]["meta_info"]["finish_reason"] for i in range(3)]
        assert [r["type"] for r in reasons] == ["length", "abort", "length"], reasons
        assert reasons[1]["code"] == "request_aborted"
        for i in (0, 2):
            assert last[i]["meta_info"]["completion_tokens"] == SHORT["max_new_tokens"]

    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        await one(client, _gen(_ids(4), {**SHORT, "n": 3}, rid="smp", stream=True), "smp-1")
        batch = {"input_ids": [_ids(4) for _ in range(3)], "sampling_params": SHORT,
                 "rid": ["p0", "p1", "p2"], "stream": True}  # fmt: skip
        await one(client, batch, "p1")
        assert await _counted_since(client, before) == {ABORTS: 2}

    _run(go)


def test_abort_request_gives_partial_output_and_is_idempotent() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        events: list[Any] = []
        body = {"messages": CHAT, **OPENAI_HOLD, "stream": True, "rid": "chat-x"}
        task = asyncio.create_task(_read_stream(client, "/v1/chat/completions", body, events))
        await _until(events, 3)
        async with _paused(client):
            first = await client.post("/abort_request", json={"rid": "chat-x"})
            assert first.json()["num_aborted"] == 1, first.text
        await asyncio.wait_for(task, 10)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_aborted"
        assert all(c["choices"][0]["finish_reason"] is None for c in events[:-2])
        again = await client.post("/abort_request", json={"rid": "chat-x"})
        assert again.status_code == 200 and again.json()["num_aborted"] == 0

        gen: list[Any] = []
        task = asyncio.create_task(_read_stream(client, "/generate", _gen(_ids(4), HOLD, stream=True, rid="g"), gen))  # fmt: skip
        await _until(gen, 2)
        async with _paused(client):
            resp = await client.post("/abort_request", json={"rid": "g"})
            assert resp.json()["num_aborted"] == 1, resp.text
        await asyncio.wait_for(task, 10)
        last = gen[-2]
        assert last["meta_info"]["finish_reason"]["type"] == "abort" and gen[-1] == "[DONE]"
        assert len(last["output_ids"]) >= len(gen[0]["output_ids"]) > 0
        assert await _counted_since(client, before) == {ABORTS: 2}

    _run(go)


def test_abort_all_ends_running_and_queued() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        running = asyncio.create_task(client.post("/v1/completions", json={"prompt": _ids(4), **OPENAI_HOLD}))  # fmt: skip
        await _wait_for(client, lambda s: s["num_running_reqs"] == 1)
        async with _paused(client):
            queued = asyncio.create_task(client.post("/generate", json=_gen(_ids(4), HOLD)))
            await _wait_for(client, lambda s: s["num_running_reqs"] == 1 and s["num_waiting_reqs"] == 1)  # fmt: skip
            resp = await client.post("/abort_request", json={"abort_all": True})
            assert resp.json()["num_aborted"] == 2, resp.text
        completion, generate = await running, await queued
        assert completion.status_code == 499
        assert completion.json()["error"]["code"] == "request_aborted"
        assert generate.status_code == 200  # /generate: the output so far, finish "abort"
        assert generate.json()["meta_info"]["finish_reason"]["type"] == "abort"
        again = await client.post("/abort_request", json={"abort_all": True})
        assert again.status_code == 200 and again.json()["num_aborted"] == 0
        assert await _counted_since(client, before) == {ABORTS: 2}

    _run(go)


# ---- timeouts ---------------------------------------------------------------------------------


def _assert_timeout(resp: httpx.Response, kind: str, value: float) -> None:
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["code"] == "timeout" and f"{kind} timeout" in err["message"], err
    assert f"{value:g} s" in err["message"], err


def test_running_waiting_and_request_timeouts() -> None:
    """A HOLD request runs into the running timeout (it decodes again after the continue); a
    request sent while generation is paused cannot leave the queue, so it runs into the waiting
    timeout; HOLD requests with a timeout of their own run into it."""

    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        started = time.monotonic()
        body = {"prompt": _ids(4), **OPENAI_HOLD}
        running = asyncio.create_task(client.post("/v1/completions", json=body))
        await _wait_for(client, lambda s: s["num_running_reqs"] == 1)
        async with _paused(client):
            waiting = await client.post("/v1/chat/completions", json={"messages": CHAT})
        _assert_timeout(waiting, "waiting", WAITING_TIMEOUT)
        _assert_timeout(await running, "running", RUNNING_TIMEOUT)
        # the timeout fired, not the end of the request (the slack is for a loaded machine)
        assert RUNNING_TIMEOUT <= time.monotonic() - started < RUNNING_TIMEOUT + 5
        own = await client.post("/generate", json=_gen(_ids(4), HOLD, timeout=0.2))
        _assert_timeout(own, "request", 0.2)
        events: list[Any] = []
        body = {"messages": CHAT, **OPENAI_HOLD, "stream": True, "timeout": 0.2}
        await _read_stream(client, "/v1/chat/completions", body, events)
        assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"
        assert await _counted_since(client, before) == {
            _aborts("timeout"): 4, _timeouts("waiting"): 1, _timeouts("running"): 1,
            _timeouts("request"): 2,
        }  # fmt: skip

    _run(go)


# ---- admission --------------------------------------------------------------------------------


def test_queue_full_is_429_with_retry_after() -> None:
    """One running slot and three queued: the fifth request in flight is refused."""

    async def go(client: httpx.AsyncClient) -> None:
        before = await _counts(client)
        async with _paused(client):
            tasks = [
                asyncio.create_task(client.post("/generate", json=_gen(_ids(4), HOLD)))
                for _ in range(4)
            ]
            await _wait_for(client, lambda s: s["num_req_states"] == 4)
            resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["code"] == "queue_full"
            aborted = await client.post("/abort_request", json={"abort_all": True})
            assert aborted.json()["num_aborted"] == 4, aborted.text
        for done in await asyncio.gather(*tasks):
            assert done.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert await _counted_since(client, before) == {QUEUE_FULL: 1, ABORTS: 4}

    _run(go)


# ---- health -----------------------------------------------------------------------------------


def test_readiness_follows_the_scheduler_heartbeat(server: LiveServer) -> None:
    error = server.unready_while_stopped("sluice::scheduler", HEALTH_TIMEOUT)
    assert error["code"] == "server_unhealthy"
