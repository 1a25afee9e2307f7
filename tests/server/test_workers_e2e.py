"""--tokenizer-worker-num N through the real server: N HTTP processes on one port (SO_REUSEPORT)
in front of one scheduler and one detokenizer, with the default model.

Every response names the worker that served it (`X-Sluice-Worker`); a test that needs a given
worker opens connections until one lands there (the kernel spreads new connections over the
workers' sockets) and then sends on that connection. Work is held in flight by construction:
generation paused in place (no forward step runs; aborts still do), never by the machine being
slow. After every test no worker and no process holds any request state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.server.live_server import (
    LiveServer,
    assert_no_state_left,
    metric,
    running_server,
    set_paused,
)

NUM_STREAMS = 64
MAX_TOKENS = 12
CHAT_ARGS = ["--max-total-tokens", "8192", "--log-level", "warning", "--dtype", "float32"]
HEADER = "x-sluice-worker"
HOLD = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}  # held by a pause in place
HELD = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}  # the same, for /generate


def _server(tmp_path_factory: Any, name: str, args: list[str]) -> Any:
    log = tmp_path_factory.mktemp(name) / "server.log"
    return running_server(None, [*CHAT_ARGS, *args], log)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with _server(tmp_path_factory, "workers_1", ["--no-embedding-model"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Two workers, with the default embedding model (an encoder routed per worker too); the
    long drain lets the last test abort a request in flight during it."""
    args = ["--tokenizer-worker-num", "2", "--shutdown-timeout", "300"]
    with _server(tmp_path_factory, "workers_2", args) as srv:
        yield srv


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = ["--tokenizer-worker-num", "3", "--no-embedding-model"]
    with _server(tmp_path_factory, "workers_3", args) as srv:
        yield srv


def _info(srv: LiveServer) -> dict[str, Any]:
    resp = httpx.get(f"{srv.base}/get_server_info", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _assert_idle(srv: LiveServer, num_workers: int) -> None:
    assert_no_state_left(srv.wait_idle(timeout=20))
    workers = _info(srv)["tokenizer_workers"]
    assert sorted(w["index"] for w in workers) == list(range(num_workers))
    assert all(w["num_req_states"] == 0 for w in workers), workers
    assert len({w["pid"] for w in workers}) == num_workers


def _client_on(base: str, want: Callable[[int], bool]) -> tuple[httpx.Client, int]:
    """A client whose (kept-alive) connection is served by a worker `want` accepts."""
    for _ in range(500):
        client = httpx.Client(base_url=base, timeout=60)
        worker = int(client.get("/health").headers[HEADER])
        if want(worker):
            return client, worker
        client.close()
    raise AssertionError("no connection reached the wanted worker")


async def _aclient_on(base: str, want: Callable[[int], bool]) -> tuple[httpx.AsyncClient, int]:
    for _ in range(500):
        client = httpx.AsyncClient(base_url=base, timeout=120)
        worker = int((await client.get("/health")).headers[HEADER])
        if want(worker):
            return client, worker
        await client.aclose()
    raise AssertionError("no connection reached the wanted worker")


async def _waiting(srv: LiveServer, num: int) -> None:
    await asyncio.to_thread(srv.wait_for, lambda s: s["num_waiting_reqs"] == num, 60)


# ---------------------------------------------------------------------------- 64 streams


async def _stream(base: str, i: int) -> tuple[str, int]:
    """Stream completion `i` on a connection of its own; (its text, the worker that served)."""
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    text = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            worker = int(resp.headers.get(HEADER, "0"))
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"]
                    text += [c["text"] for c in choice]
    return "".join(text), worker


def _streams(base: str) -> list[tuple[str, int]]:
    async def go() -> list[tuple[str, int]]:
        return await asyncio.gather(*(_stream(base, i) for i in range(NUM_STREAMS)))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference(single: LiveServer) -> list[str]:
    return [text for text, _ in _streams(single.base)]


@pytest.mark.parametrize("name,num", [("two", 2), ("three", 3)])
def test_64_streams_equal_one_worker(
    name: str, num: int, reference: list[str], request: pytest.FixtureRequest
) -> None:
    srv = request.getfixturevalue(name)
    results = _streams(srv.base)
    assert [text for text, _ in results] == reference
    assert all(text for text in reference)
    assert {worker for _, worker in results} == set(range(num))  # every worker served some
    _assert_idle(srv, num)


def test_embeddings_through_every_worker(two: LiveServer) -> None:
    seen, vectors = set(), []
    while len(seen) < 2:
        client, worker = _client_on(two.base, lambda w: w not in seen)
        with contextlib.closing(client):
            resp = client.post("/v1/embeddings", json={"input": ["a red fox", "a blue sea"]})
        assert resp.status_code == 200, resp.text
        seen.add(worker)
        vectors.append([d["embedding"] for d in resp.json()["data"]])
    assert vectors[0] == vectors[1]
    _assert_idle(two, 2)


def test_an_encoder_main_model_with_two_workers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """--model-path an embedding model: its scheduler sends each output to its own worker."""
    from sluice.checkpoint.encoder_config import default_embedding_model_path

    path = default_embedding_model_path()
    if path is None:
        pytest.skip("the default embedding model is not installed")
    log = tmp_path_factory.mktemp("workers_encoder") / "server.log"
    with running_server(
        path, ["--tokenizer-worker-num", "2", "--log-level", "warning"], log
    ) as srv:
        seen, vectors = set(), []
        while len(seen) < 2:
            client, worker = _client_on(srv.base, lambda w: w not in seen)
            with contextlib.closing(client):
                resp = client.post("/v1/embeddings", json={"input": ["a red fox"] * 3})
            assert resp.status_code == 200, resp.text
            seen.add(worker)
            vectors.append([d["embedding"] for d in resp.json()["data"]])
        assert vectors[0] == vectors[1]
        info = _info(srv)
        assert info["internal_state"]["num_req_states"] == 0
        assert [w["index"] for w in info["tokenizer_workers"]] == [0, 1]


# ---------------------------------------------------------------------------- aborts


def test_abort_of_a_request_owned_by_another_worker(two: LiveServer) -> None:
    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        owner_client, owner = await _aclient_on(two.base, lambda w: True)
        await set_paused(owner_client, True)
        try:
            body = {"text": "Tell me a long story.", "rid": "held-1", "sampling_params": HELD}
            call = asyncio.create_task(owner_client.post("/generate", json=body))
            await asyncio.to_thread(two.wait_for, lambda s: s["num_waiting_reqs"] == 1)
            other, worker = await _aclient_on(two.base, lambda w: w != owner)
            async with contextlib.aclosing(other):
                aborted = await other.post("/abort_request", json={"rid": "held-1"})
            assert worker != owner
            resp = await call
        finally:
            await set_paused(owner_client, False)
            await owner_client.aclose()
        return aborted.json(), resp.json()

    aborted, resp = asyncio.run(go())
    assert aborted == {"success": True, "num_aborted": 1}
    assert resp["meta_info"]["finish_reason"]["type"] == "abort", resp
    _assert_idle(two, 2)


def test_abort_storm_leaves_nothing_in_any_worker(three: LiveServer) -> None:
    """Requests on connections of their own, held (paused in place); a third aborted by rid
    through whatever worker a new connection reaches, a third disconnected, the rest ended by
    abort_all through one worker; then the counters agree and nothing is left anywhere."""
    rng = random.Random(11)
    num = 48
    before = three.metrics()
    served: set[int] = set()

    async def go() -> list[Any]:
        async with httpx.AsyncClient(base_url=three.base, timeout=120) as control:
            await set_paused(control, True)
            try:
                clients = [httpx.AsyncClient(base_url=three.base, timeout=120) for _ in range(num)]
                bodies = [
                    {"text": f"storm {i} " * rng.randint(1, 20), "rid": f"st{i}",
                     "sampling_params": HELD}
                    for i in range(num)
                ]  # fmt: skip
                calls = [
                    asyncio.create_task(c.post("/generate", json=body))
                    for c, body in zip(clients, bodies, strict=True)
                ]
                await _waiting(three, num)
                for k, i in enumerate(range(0, num, 3)):  # by rid, through each worker in turn
                    one, _ = await _aclient_on(three.base, lambda w, k=k: w == k % 3)
                    async with contextlib.aclosing(one):
                        resp = await one.post("/abort_request", json={"rid": f"st{i}"})
                    assert resp.json()["num_aborted"] == 1, (i, resp.text)
                    served.add(int(resp.headers[HEADER]))
                await _waiting(three, num - num // 3)
                for i in range(1, num, 3):
                    calls[i].cancel()
                await _waiting(three, num // 3)
                resp = await control.post("/abort_request", json={"abort_all": True})
                assert resp.json()["num_aborted"] == num // 3, resp.text
                results = await asyncio.gather(*calls, return_exceptions=True)
                for c in clients:
                    await c.aclose()
            finally:
                await set_paused(control, False)
        return results

    results = asyncio.run(go())
    assert served == {0, 1, 2}  # the aborts came through every worker
    ended = [r for i, r in enumerate(results) if i % 3 != 1]
    assert all(r.status_code == 200 for r in ended)
    assert all(r.json()["meta_info"]["finish_reason"]["type"] == "abort" for r in ended)
    _assert_idle(three, 3)
    after = three.metrics()
    for cause, count in (("abort_request", 2 * num // 3), ("client_disconnect", num // 3)):
        name = f'sluice_request_aborts_total{{cause="{cause}"}}'
        assert metric(after, name) - metric(before, name) == count, cause
    assert metric(after, "sluice_unknown_rid_outputs_total") == 0


@pytest.mark.parametrize("abort_through", ["owner", "other"])
def test_the_same_rid_on_two_workers_leaves_the_first_request_whole(
    two: LiveServer, abort_through: str
) -> None:
    """A client rid streaming through one worker, sent again through another: the second is a
    400, and the first keeps its decode state (the detokenizer keys it by its worker); an abort
    of the rid, through either worker (the other asks the owner), then ends the first.

    The stream's line iterator is held for the whole test: an `async for` left with `break`
    drops it, and its finalizer closes the connection, which the server rightly takes for a
    client disconnect (the first request would then be gone before the second is sent)."""
    body = {"text": "Tell me a long story.", "rid": "dup", "sampling_params": HELD}

    def detokenizer_states() -> int:
        return _info(two)["internal_state"]["num_detokenizer_states"]

    async def go() -> tuple[list[int], httpx.Response, dict[str, Any], dict[str, Any]]:
        first, owner = await _aclient_on(two.base, lambda w: True)
        second, _ = await _aclient_on(two.base, lambda w: w != owner)
        counts = []
        try:
            async with first.stream("POST", "/generate", json={**body, "stream": True}) as resp:
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break  # "dup" has streamed: its decode state exists
                await set_paused(first, True)  # held in place from here
                counts.append(await asyncio.to_thread(detokenizer_states))
                again = await second.post("/generate", json=body)
                counts.append(await asyncio.to_thread(detokenizer_states))
                aborter = first if abort_through == "owner" else second
                aborted = (await aborter.post("/abort_request", json={"rid": "dup"})).json()
                events = [json.loads(ln[6:]) async for ln in lines if ln.startswith("data: {")]
        finally:
            await set_paused(first, False)
            await first.aclose()
            await second.aclose()
        return counts, again, aborted, events[-1]

    counts, again, aborted, last = asyncio.run(go())
    assert again.status_code == 400 and "dup" in again.text, again.text
    assert counts == [1, 1]  # the refusal did not end the first request's state
    assert aborted == {"success": True, "num_aborted": 1}
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last
    _assert_idle(two, 2)


def test_images_through_every_worker(
    tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str
) -> None:
    """Each worker runs its own media pool (a worker is not a daemonic process, which could not
    start one); the same image gives the same greedy tokens through either."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from tests.tiny_models import make_tiny_llava

    path = make_tiny_llava(tmp_path_factory.mktemp("workers_llava"), tokenizer_dir=smollm2_hf_dir)
    pixels = np.random.default_rng(3).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"text": "<image> What is it?", "image_data": url,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    log = tmp_path_factory.mktemp("workers_images") / "server.log"
    args = ["--tokenizer-worker-num", "2", "--dtype", "float32", "--log-level", "warning"]
    with running_server(path, args, log) as srv:
        outputs = {}
        while len(outputs) < 2:
            client, worker = _client_on(srv.base, lambda w: w not in outputs)
            with contextlib.closing(client):
                resp = client.post("/generate", json=body)
            assert resp.status_code == 200, resp.text
            outputs[worker] = resp.json()["output_ids"]
        assert outputs[0] == outputs[1] and len(outputs[0]) == 6
        assert_no_state_left(srv.wait_idle(timeout=20))


# ---------------------------------------------------------------------------- sessions, control


def test_session_opened_through_one_worker_continues_through_another(three: LiveServer) -> None:
    a, wa = _client_on(three.base, lambda w: True)
    b, wb = _client_on(three.base, lambda w: w != wa)
    c, _ = _client_on(three.base, lambda w: w not in (wa, wb))
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with contextlib.closing(a), contextlib.closing(b), contextlib.closing(c):
        sid = a.post("/open_session", json={"timeout": 60}).json()
        assert isinstance(sid, str) and three.state()["num_sessions"] == 1
        first = [101, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
        t1 = b.post("/generate", json={"input_ids": first, "sampling_params": greedy,
                                       "session_params": {"id": sid}})  # fmt: skip
        assert t1.status_code == 200, t1.text
        more = [900, 901, 902]
        t2 = c.post("/generate", json={"input_ids": more, "sampling_params": greedy,
                                       "session_params": {"id": sid}})  # fmt: skip
        assert t2.status_code == 200, t2.text
        full = first + t1.json()["output_ids"] + more
        assert t2.json()["meta_info"]["prompt_tokens"] == len(full)  # built on the first turn
        assert t2.json()["meta_info"]["cached_tokens"] == len(full) - len(more) - 1
        assert b.post("/close_session", json={"session_id": sid}).status_code == 200
        assert three.state()["num_sessions"] == 0
        for client in (a, b, c):
            assert client.post("/flush_cache").status_code == 200
    _assert_idle(three, 3)


def test_metrics_sum_across_workers(three: LiveServer) -> None:
    route = 'sluice_http_requests_total{route="/v1/completions",status="200"}'
    names = (route, "sluice_generation_tokens_total", "sluice_e2e_request_latency_seconds_count")
    before = three.metrics()
    num = 12
    served = set()
    for i in range(num):
        with httpx.Client(base_url=three.base, timeout=60) as c:
            body = {"prompt": f"count {i}", "max_tokens": 3, "ignore_eos": True}
            resp = c.post("/v1/completions", json=body)
            assert resp.status_code == 200
            served.add(int(resp.headers[HEADER]))
    assert len(served) > 1
    seen = set()
    for _ in range(200):  # a scrape through each worker gives the same sums
        with httpx.Client(base_url=three.base, timeout=60) as c:
            resp = c.get("/metrics")
        seen.add(int(resp.headers[HEADER]))
        for name, want in zip(names, (num, 3 * num, num), strict=True):
            assert metric(resp.text, name) - metric(before, name) == want, (name, resp.headers)
        if len(seen) == 3:
            break
    assert seen == {0, 1, 2}


# ---------------------------------------------------------------------------- death and drain


def _tree(srv: LiveServer) -> list[psutil.Process]:
    return [srv.ps, *srv.ps.children(recursive=True)]


def _assert_all_gone(procs: list[psutil.Process]) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def test_a_dead_worker_fails_the_server_with_503_and_no_orphans(three: LiveServer) -> None:
    """Worker 1 killed with a request held on worker 2: worker 2 is told and answers 503, the
    server exits 1, nothing is left. This ends the module's `three`: it comes after every other
    test of it."""
    procs = _tree(three)
    assert len([p for p in procs if "sluice::http-" in " ".join(p.cmdline())]) == 2

    async def go() -> httpx.Response:
        client, _ = await _aclient_on(three.base, lambda w: w == 2)
        async with contextlib.aclosing(client):
            await set_paused(client, True)
            body = {"prompt": "Tell me a long story.", **HOLD}
            call = asyncio.create_task(client.post("/v1/completions", json=body))
            await _waiting(three, 1)
            three.child("sluice::http-1").kill()
            return await call

    resp = asyncio.run(go())
    assert resp.status_code == 503, resp.text
    assert three.proc.wait(20) == 1
    _assert_all_gone(procs)
    assert "the http-1 process died" in three.log.read_text()


def test_sigterm_drains_every_worker_and_a_fan_out_does_not_wait_for_one_that_left(
    two: LiveServer,
) -> None:
    """SIGTERM with a request on each worker, paused in place (the drain continues a paused
    server): worker 1's finishes whole (200, its 16 tokens), then worker 1, with nothing left in
    flight, ends its drain and exits (announcing it); /get_server_info and an abort by rid of
    worker 0's long request, each a fan-out through worker 0, then answer without waiting out
    the 10 s a silent worker would cost; the server exits 0 and leaves nothing. This ends the
    module's `two`: it comes after every other test of it."""
    procs = _tree(two)
    worker_1 = next(p for p in procs if "sluice::http-1" in " ".join(p.cmdline()))

    async def go() -> tuple[httpx.Response, float, dict[str, Any], float, dict[str, Any], Any]:
        client, _ = await _aclient_on(two.base, lambda w: w == 0)
        other, _ = await _aclient_on(two.base, lambda w: w == 1)
        async with contextlib.aclosing(client), contextlib.aclosing(other):
            await set_paused(client, True)  # into the queue first; the drain continues them
            body = {"text": "Tell me a long story.", "rid": "long", "sampling_params": HELD}
            held = asyncio.create_task(client.post("/generate", json=body))
            await _waiting(two, 1)
            body = {"prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
            short = asyncio.create_task(other.post("/v1/completions", json=body))
            await _waiting(two, 2)
            two.proc.send_signal(signal.SIGTERM)
            finished = await short
            await asyncio.to_thread(worker_1.wait, 60)  # gone (its code: the launcher logs it)
            start = time.monotonic()
            info = await client.get("/get_server_info")
            info_s = time.monotonic() - start
            assert info.status_code == 200, (info_s, info.text)
            start = time.monotonic()
            aborted = await client.post("/abort_request", json={"rid": "long"})
            abort_s = time.monotonic() - start
            assert aborted.status_code == 200, (abort_s, aborted.text)
            return finished, info_s, info.json(), abort_s, aborted.json(), (await held).json()

    finished, info_s, info, abort_s, aborted, resp = asyncio.run(go())
    assert finished.status_code == 200, finished.text
    assert finished.json()["usage"]["completion_tokens"] == 16
    assert info_s < 5 and abort_s < 5, (info_s, abort_s)  # a silent worker: 10 s each
    assert [w["index"] for w in info["tokenizer_workers"]] == [0]
    assert aborted == {"success": True, "num_aborted": 1}
    assert resp["meta_info"]["finish_reason"]["type"] == "abort", resp
    assert two.proc.wait(30) == 0
    _assert_all_gone(procs)
