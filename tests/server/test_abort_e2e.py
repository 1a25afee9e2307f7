"""Abort, timeouts, admission and health through the real server (all processes, tiny model).

One server with one running slot, 2-token prefill chunks and a 4096-position tiny model, so the
phases are reached deterministically: a second request waits in the queue, a long prompt spends
hundreds of steps in chunked prefill, a long completion decodes for seconds. After every test no
process holds any state of any request and every KV slot is free or cached.
"""

from __future__ import annotations

import asyncio
import json
import random
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
)

# generous enough that a loaded CI machine never expires a request a test means to abort
WAITING_TIMEOUT, RUNNING_TIMEOUT, HEALTH_TIMEOUT = 2.0, 3.0, 1.5
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}  # seconds: can be aborted
# decode steps that no CPU runs within RUNNING_TIMEOUT (the tiny model takes about 1 ms a step)
OUTLIVES_RUNNING_TIMEOUT = 15000
SHORT = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
# long enough that, with one running slot, the aborted part is still queued when the abort lands
MEDIUM = {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0}
CHAT = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("abort_e2e")
    model = long_context_tiny_llama(tmp / "model", smollm2_hf_dir)
    args = ["--max-total-tokens", "16384", "--chunked-prefill-size", "2",
            "--max-running-requests", "1", "--max-queued-requests", "3",
            "--waiting-timeout", str(WAITING_TIMEOUT), "--running-timeout", str(RUNNING_TIMEOUT),
            "--health-timeout", str(HEALTH_TIMEOUT), "--log-level", "warning"]  # fmt: skip
    with running_server(model, args, tmp / "server.log") as srv:
        yield srv


@pytest.fixture(autouse=True)
def nothing_left_behind(server: LiveServer) -> Iterator[None]:
    yield
    assert_no_state_left(server.wait_idle())


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
        front: list[Any] = []
        a = asyncio.create_task(_read_stream(client, "/generate", _gen(_ids(4), LONG, stream=True), front))  # fmt: skip
        await _until(front, 1)
        body = _gen(_ids(4), LONG, stream=stream)
        b = asyncio.create_task(
            _read_stream(client, "/generate", body, []) if stream else client.post("/generate", json=body)
        )  # fmt: skip
        await _wait_for(client, lambda s: s["num_waiting_reqs"] == 1)
        await _disconnect(b)
        state = await _wait_for(client, lambda s: s["num_waiting_reqs"] == 0)
        assert state["num_running_reqs"] == 1 and state["num_req_states"] == 1, state
        await _disconnect(a)

    _run(go)


def test_disconnect_during_chunked_prefill() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        events: list[Any] = []
        body = _gen(_ids(1500), {**LONG, "max_new_tokens": 2000}, stream=True)  # 750 steps
        task = asyncio.create_task(_read_stream(client, "/generate", body, events))
        state = await _wait_for(client, lambda s: s["num_running_reqs"] == 1)
        assert state["kv_pool"]["in_use"] + state["kv_pool"]["cached"] < 1500, state
        await _disconnect(task)
        assert events == []  # no token yet: it was still prefilling

    _run(go)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_decode(stream: bool) -> None:
    async def go(client: httpx.AsyncClient) -> None:
        events: list[Any] = []
        body = _gen(_ids(4), LONG, stream=stream)
        if stream:
            task = asyncio.create_task(_read_stream(client, "/generate", body, events))
            await _until(events, 3)
        else:
            task = asyncio.create_task(client.post("/generate", json=body))
            await _wait_for(client, lambda s: s["num_running_reqs"] == 1)
            await asyncio.sleep(0.05)  # a few dozen decode steps
        await _disconnect(task)

    _run(go)


def test_disconnect_one_of_n_and_one_prompt_of_a_batch() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        events: list[Any] = []
        body = {"prompt": _ids(4), "n": 3, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        task = asyncio.create_task(_read_stream(client, "/v1/completions", body, events))
        await _until(events, 1)
        await _disconnect(task)  # all three samples go
        await _wait_for(client, lambda s: s["num_req_states"] == 0)
        batch = {"input_ids": [_ids(4), _ids(4)], "sampling_params": LONG, "stream": True}
        task = asyncio.create_task(_read_stream(client, "/generate", batch, events := []))
        await _until(events, 1)
        await _disconnect(task)

    _run(go)


# ---- /abort_request ---------------------------------------------------------------------------


def test_abort_one_sample_and_one_prompt_by_rid() -> None:
    """With one running slot, part 0 runs while parts 1 and 2 queue: aborting part 1 as soon as
    part 0 streams its first token hits it in the queue. On a badly loaded machine part 1 can
    still expire (waiting timeout) before the abort lands: then the attempt is repeated."""

    async def attempt(client: httpx.AsyncClient, body: dict[str, Any], rid: str) -> bool:
        events: list[Any] = []
        task = asyncio.create_task(_read_stream(client, "/generate", body, events))
        await _until(events, 1)
        resp = await client.post("/abort_request", json={"rid": rid})
        await asyncio.wait_for(task, 20)
        if resp.json()["num_aborted"] == 0:
            return False
        assert events[-1] == "[DONE]"
        last = {e["index"]: e for e in events[:-1]}
        reasons = [last[i]["meta_info"]["finish_reason"] for i in range(3)]
        assert [r["type"] for r in reasons] == ["length", "abort", "length"], reasons
        assert reasons[1]["code"] == "request_aborted"
        assert last[0]["meta_info"]["completion_tokens"] == SHORT["max_new_tokens"]
        return True

    async def go(client: httpx.AsyncClient) -> None:
        for body, rid in (
            (_gen(_ids(4), {**SHORT, "n": 3}, rid="smp", stream=True), "smp-1"),
            ({"input_ids": [_ids(4)] * 3, "sampling_params": SHORT, "rid": ["p0", "p1", "p2"],
              "stream": True}, "p1"),
        ):  # fmt: skip
            for _ in range(3):
                if await attempt(client, body, rid):
                    break
            else:
                raise AssertionError(f"{rid} was never still queued when its abort arrived")

    _run(go)


def test_abort_request_gives_partial_output_and_is_idempotent() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        events: list[Any] = []
        body = {"messages": CHAT, "max_tokens": 3000, "stream": True, "rid": "chat-x"}
        task = asyncio.create_task(_read_stream(client, "/v1/chat/completions", body, events))
        await _until(events, 3)
        first = await client.post("/abort_request", json={"rid": "chat-x"})
        assert first.json()["num_aborted"] == 1
        await asyncio.wait_for(task, 10)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_aborted"
        assert all(c["choices"][0]["finish_reason"] is None for c in events[:-2])
        again = await client.post("/abort_request", json={"rid": "chat-x"})
        assert again.status_code == 200 and again.json()["num_aborted"] == 0

        gen: list[Any] = []
        task = asyncio.create_task(_read_stream(client, "/generate", _gen(_ids(4), LONG, stream=True, rid="g"), gen))  # fmt: skip
        await _until(gen, 2)
        await client.post("/abort_request", json={"rid": "g"})
        await asyncio.wait_for(task, 10)
        last = gen[-2]
        assert last["meta_info"]["finish_reason"]["type"] == "abort" and gen[-1] == "[DONE]"
        assert len(last["output_ids"]) >= len(gen[0]["output_ids"]) > 0

    _run(go)


def test_abort_all_ends_running_and_queued() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        running = asyncio.create_task(client.post("/v1/completions", json={"prompt": _ids(4), "max_tokens": 3000, "ignore_eos": True}))  # fmt: skip
        queued = asyncio.create_task(client.post("/generate", json=_gen(_ids(4), LONG)))
        await _wait_for(client, lambda s: s["num_running_reqs"] == 1 and s["num_waiting_reqs"] == 1)  # fmt: skip
        resp = await client.post("/abort_request", json={"abort_all": True})
        assert resp.json()["num_aborted"] == 2
        completion, generate = await running, await queued
        assert completion.status_code == 499
        assert completion.json()["error"]["code"] == "request_aborted"
        assert generate.status_code == 200  # /generate: the output so far, finish "abort"
        assert generate.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await client.post("/abort_request", json={"abort_all": True})).status_code == 200

    _run(go)


# ---- timeouts ---------------------------------------------------------------------------------


def _assert_timeout(resp: httpx.Response, kind: str, value: float) -> None:
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["code"] == "timeout" and f"{kind} timeout" in err["message"], err
    assert f"{value:g} s" in err["message"], err


def test_running_waiting_and_request_timeouts() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        started = time.monotonic()
        body = {"prompt": _ids(4), "max_tokens": OUTLIVES_RUNNING_TIMEOUT, "ignore_eos": True}
        running = asyncio.create_task(client.post("/v1/completions", json=body))
        await _wait_for(client, lambda s: s["num_running_reqs"] == 1)
        waiting = await client.post("/v1/chat/completions", json={"messages": CHAT})
        _assert_timeout(waiting, "waiting", WAITING_TIMEOUT)
        _assert_timeout(await running, "running", RUNNING_TIMEOUT)
        assert time.monotonic() - started < RUNNING_TIMEOUT + 1.0
        own = await client.post("/generate", json=_gen(_ids(4), LONG, timeout=0.2))
        _assert_timeout(own, "request", 0.2)
        events: list[Any] = []
        body = {"messages": CHAT, "max_tokens": 3000, "stream": True, "timeout": 0.2}
        await _read_stream(client, "/v1/chat/completions", body, events)
        assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"

    _run(go)


# ---- admission --------------------------------------------------------------------------------


def test_queue_full_is_429_with_retry_after() -> None:
    async def go(client: httpx.AsyncClient) -> None:
        body = _gen(_ids(4), LONG)
        tasks = [asyncio.create_task(client.post("/generate", json=body)) for _ in range(4)]
        await _wait_for(client, lambda s: s["num_req_states"] == 4)
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "queue_full"
        await client.post("/abort_request", json={"abort_all": True})
        await asyncio.gather(*tasks)

    _run(go)


# ---- health, metrics --------------------------------------------------------------------------


def test_readiness_follows_the_scheduler_heartbeat(server: LiveServer) -> None:
    error = server.unready_while_stopped("sluice::scheduler", HEALTH_TIMEOUT)
    assert error["code"] == "server_unhealthy"


def test_metrics_count_every_early_end(server: LiveServer) -> None:
    page = server.metrics()
    assert metric(page, "sluice_unknown_rid_outputs_total") == 0
    assert metric(page, 'sluice_request_aborts_total{cause="client_disconnect"}') >= 8
    assert metric(page, 'sluice_request_aborts_total{cause="abort_request"}') >= 4
    assert metric(page, 'sluice_request_aborts_total{cause="timeout"}') >= 4
    for kind in ("waiting", "running", "request"):
        assert metric(page, f'sluice_request_timeouts_total{{kind="{kind}"}}') >= 1, kind
    assert metric(page, 'sluice_rejected_requests_total{reason="queue_full"}') >= 1
