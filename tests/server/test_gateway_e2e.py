"""SGLang's model gateway (`sglang-router` 0.3.2, a Rust binary) in front of two real servers.

What the gateway does with a worker, as this test found it:
- It registers each worker from `GET /server_info` (`model_path`, `served_model_name`) and
  `GET /model_info` (`model_type`, `architectures`), after probing it for gRPC; it names the model
  `served_model_name`, and requests must name that model.
- It routes by its own approximate prefix tree (cache_aware): text that matches a worker's
  earlier requests by more than 30% goes to that worker, other text to the least loaded one
  (its count of requests it has in flight there).
- It has no `/abort_request` route (404). A request is aborted by rid at the worker that holds
  it (the rid of `/generate` passes through unchanged); a client that disconnects from the
  gateway is aborted on the worker, since the gateway drops its upstream connection.

A request held in flight cannot finish within the test: it asks for HELD_TOKENS tokens, several
minutes of decoding at the tiny model's speed, and is aborted within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.server.worker_info import model_info
from tests.server.live_server import LiveServer, assert_no_state_left, die_with_parent, metric
from tests.tiny_models import make_tiny_llama

CONTEXT_LEN = 1 << 17  # the tiny model's positions: KV of 256 bytes a token, 32 MiB in all
HELD_TOKENS = CONTEXT_LEN - 1024  # minutes of decoding: outlives any test here
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """`python -m sglang_router.launch_router` on loopback ports, cache_aware, in front of
    `workers`, health-checking each every second."""

    def __init__(self, workers: list[LiveServer], log: Path) -> None:
        self.base = f"http://127.0.0.1:{_free_port()}"
        self.log = log
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", self.base.rsplit(":", 1)[1], "--worker-urls", *(w.base for w in workers),
            "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(_free_port()), "--health-check-interval-secs", "1",
            "--log-level", "info", "--shutdown-grace-period-secs", "1",
        ]  # fmt: skip
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )

    def wait_registered(self, num_workers: int, timeout: float = 60) -> list[dict[str, Any]]:
        """Until the gateway lists `num_workers` healthy workers; their records."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.text()
            with contextlib.suppress(httpx.HTTPError):
                workers = httpx.get(f"{self.base}/workers", timeout=2).json()["workers"]
                if len(workers) == num_workers and all(w["is_healthy"] for w in workers):
                    return workers
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.2)

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text())  # without its colours

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(
    tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str
) -> Iterator[list[LiveServer]]:
    """Two servers of one tiny model, started at once."""
    pytest.importorskip("sglang_router", reason="sglang-router (a test extra) is not installed")
    tmp = tmp_path_factory.mktemp("gateway_e2e")
    model = make_tiny_llama(
        tmp / "gw-tiny-llama", tokenizer_dir=smollm2_hf_dir, max_position_embeddings=CONTEXT_LEN
    )
    args = ["--max-total-tokens", str(CONTEXT_LEN), "--no-embedding-model"]
    servers: list[LiveServer] = []
    try:
        for i in range(2):
            servers.append(LiveServer(model, args, tmp / f"worker{i}.log"))
        for srv in servers:
            srv.wait_ready()
        yield servers
    finally:
        for srv in servers:
            srv.stop()


@pytest.fixture(scope="module")
def log_offsets(workers: list[LiveServer]) -> list[int]:
    """Where each worker's log stood before the gateway first spoke to it."""
    return [w.log.stat().st_size for w in workers]


@pytest.fixture(scope="module")
def gateway(
    workers: list[LiveServer], log_offsets: list[int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    gw = Gateway(workers, tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        gw.wait_registered(len(workers))
        yield gw
    finally:
        gw.stop()


@pytest.fixture(autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "workers" in request.fixturenames:
        for srv in request.getfixturevalue("workers"):
            assert_no_state_left(srv.wait_idle())


def _name(workers: list[LiveServer]) -> str:
    return httpx.get(f"{workers[0].base}/v1/models").json()["data"][0]["id"]


def _served(srv: LiveServer, route: str) -> float:
    """How many requests to `route` this worker answered with 200."""
    return metric(srv.metrics(), f'sluice_http_requests_total{{route="{route}",status="200"}}')


def _fresh_text(num_words: int) -> str:
    """Words no earlier request sent, so no prefix tree (the gateway's or a worker's) has them."""
    rng = random.Random(uuid.uuid4().int)
    return f"{uuid.uuid4().hex} " + " ".join(rng.choice(WORDS) for _ in range(num_words))


def _running(srv: LiveServer) -> int:
    return int(srv.state()["num_running_reqs"])


@contextlib.asynccontextmanager
async def _held_stream(client: httpx.AsyncClient, rid: str) -> AsyncIterator[list[Any]]:
    """A streamed /generate through the gateway that cannot finish within the test, running
    (its first tokens arrived) when the block starts; its SSE events, appended as they come.
    Cancelled (a disconnect) after the block unless it ended in it."""
    body = {
        "text": _fresh_text(8), "rid": rid, "stream": True,
        "sampling_params": {"max_new_tokens": HELD_TOKENS, "ignore_eos": True, "temperature": 0},
    }  # fmt: skip
    events: list[Any] = []

    async def read() -> None:
        async with client.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))

    task = asyncio.create_task(read())
    try:
        deadline = time.monotonic() + 30
        while len(events) < 2:
            assert not task.done(), task.exception() if not task.cancelled() else "cancelled"
            assert time.monotonic() < deadline, "the held stream did not start"
            await asyncio.sleep(0.01)
        yield events
        if events[-1] == "[DONE]":
            await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _run(gateway: Gateway, go: Any) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(base_url=gateway.base, timeout=60) as client:
            return await asyncio.wait_for(go(client), 120)

    return asyncio.run(main())


def _holder(workers: list[LiveServer]) -> tuple[LiveServer, LiveServer]:
    """(the worker running the one request in flight, the other)."""
    running = [_running(w) for w in workers]
    assert sorted(running) == [0, 1], running
    return (workers[0], workers[1]) if running[0] else (workers[1], workers[0])


# ---- the info routes, without a gateway ------------------------------------------------------


def test_new_info_routes_are_the_old_ones_with_resolved_names(
    make_client: Any, fake_tm: Any, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fake_tm.model_config = _FakeModelConfig(str(tmp_path / "m.gguf"), str(tmp_path))
    client = make_client()  # served_model_name unset: the name is derived
    info = client.get("/model_info").json()
    assert info == client.get("/get_model_info").json()
    assert info == {
        "model_path": str(tmp_path / "m.gguf"), "tokenizer_path": str(tmp_path),
        "served_model_name": "fake-model", "architecture": "LlamaForCausalLM",
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "context_length": 64,
        "vocab_size": 15, "is_generation": True,
    }  # fmt: skip
    new, old = client.get("/server_info").json(), client.get("/get_server_info").json()
    assert new.keys() == old.keys() and new["internal_state"].keys() == old["internal_state"].keys()
    for key in ("model_path", "tokenizer_path", "served_model_name", "version", "port"):
        assert new[key] == old[key] == {**info, "version": new["version"], "port": 30000}[key]


def test_info_routes_without_a_model_config(make_client: Any) -> None:
    info = make_client(served_model_name="alias").get("/model_info").json()
    assert info["served_model_name"] == "alias" and info["model_type"] is None
    assert info["model_path"] is None and info["architectures"] == []


def test_model_type_is_none_for_a_broken_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[not json")
    cfg = _FakeModelConfig("x", str(tmp_path))
    tm = type("TM", (), {"context_len": 8, "model_config": cfg, "can_generate": True})
    assert model_info(tm(), None, "m")["model_type"] is None


class _FakeModelConfig:
    architecture, vocab_size = "LlamaForCausalLM", 15

    def __init__(self, source_path: str, hf_dir: str) -> None:
        self.source_path, self.hf_dir = source_path, hf_dir


def test_a_protocol_probe_is_logged_as_info(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from sluice.server.worker_info import UVICORN_LOGGER, quiet_protocol_probes

    quiet_protocol_probes()
    quiet_protocol_probes()  # once per process, however many apps
    target = logging.getLogger(UVICORN_LOGGER)
    assert len(target.filters) == 1, target.filters
    with caplog.at_level(logging.INFO, logger=UVICORN_LOGGER):
        target.warning("Invalid HTTP request received.")
        target.warning("something else")
    probe, other = caplog.records
    assert probe.levelno == logging.INFO and "not HTTP/1.x" in probe.getMessage()
    assert other.levelno == logging.WARNING and other.getMessage() == "something else"


# ---- the gateway in front of two servers ------------------------------------------------------


def test_registering_and_polling_logs_nothing_alarming(
    gateway: Gateway, workers: list[LiveServer], log_offsets: list[int]
) -> None:
    """The gateway asks the new route names first and gets them; its probes and every-second
    health checks leave no warning, error or 404 in either worker's log."""
    deadline = time.monotonic() + 15
    for srv, offset in zip(workers, log_offsets, strict=True):
        while (lines := srv.log.read_text()[offset:]).count('"GET /health HTTP/1.1" 200') < 3:
            assert time.monotonic() < deadline, lines  # three health checks of each worker
            time.sleep(0.2)
        for route in ("/server_info", "/model_info"):
            assert f'"GET {route} HTTP/1.1" 200' in lines, lines
        alarming = [
            line for line in lines.splitlines()
            if re.search(r"WARNING|ERROR|Traceback|HTTP/1.1\" [45]\d\d", line)
        ]  # fmt: skip
        assert not alarming, lines
    text = gateway.text()
    assert "falling back" not in text and "Failed" not in text, text


def test_models_through_the_gateway_name_the_served_model(
    gateway: Gateway, workers: list[LiveServer]
) -> None:
    name = _name(workers)
    assert name == "gw-tiny-llama"
    models = httpx.get(f"{gateway.base}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [name]
    registered = httpx.get(f"{gateway.base}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in registered) == sorted(w.base for w in workers)
    for record in registered:
        assert record["model_id"] == name and record["metadata"]["served_model_name"] == name
        assert record["metadata"]["model_type"] == "llama"
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    resp = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == name and resp.json()["usage"]["completion_tokens"] == 3


def test_requests_reach_both_workers(gateway: Gateway, workers: list[LiveServer]) -> None:
    """With one request in flight on one worker, new text reaches the other one too (0.3.2 sent
    all of it there, the least loaded; the test asks only that the other one is used)."""
    name = _name(workers)

    async def go(client: httpx.AsyncClient) -> None:
        rid = f"held-{uuid.uuid4().hex}"
        async with _held_stream(client, rid):
            holder, other = _holder(workers)
            before = [_served(w, "/v1/completions") for w in (holder, other)]
            for _ in range(3):
                body = {"model": name, "prompt": _fresh_text(20), "max_tokens": 2}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
            after = [_served(w, "/v1/completions") for w in (holder, other)]
            moved = [a - b for a, b in zip(after, before, strict=True)]
            assert sum(moved) == 3 and moved[1] >= 1, moved
            assert _running(holder) == 1  # still held: it did not end early either
            await _abort_at_workers(workers, rid)

    _run(gateway, go)
    assert all(_served(w, "/generate") + _served(w, "/v1/completions") > 0 for w in workers)


async def _abort_at_workers(workers: list[LiveServer], rid: str) -> list[int]:
    """POST /abort_request {rid} to every worker (idempotent); each one's num_aborted."""
    async with httpx.AsyncClient(timeout=30) as client:
        replies = [
            (await client.post(f"{w.base}/abort_request", json={"rid": rid})).json()
            for w in workers
        ]
    assert all(r["success"] for r in replies), replies
    return [r["num_aborted"] for r in replies]


def test_abort_by_rid_of_a_request_through_the_gateway(
    gateway: Gateway, workers: list[LiveServer]
) -> None:
    """The gateway has no /abort_request (404); the rid it passed through aborts the request at
    its worker, and the stream through the gateway ends with an abort and [DONE]."""

    async def go(client: httpx.AsyncClient) -> list[Any]:
        rid = f"held-{uuid.uuid4().hex}"
        async with _held_stream(client, rid) as events:
            assert events[0]["meta_info"]["id"] == rid  # the gateway keeps the client's rid
            routed = await client.post("/abort_request", json={"rid": rid})
            assert routed.status_code == 404, routed.text
            holder, _ = _holder(workers)  # the gateway's 404 left it running
            num_aborted = await _abort_at_workers(workers, rid)
            assert sorted(num_aborted) == [0, 1] and num_aborted[workers.index(holder)] == 1
            deadline = time.monotonic() + 30
            while events[-1] != "[DONE]":
                assert time.monotonic() < deadline, events[-3:]
                await asyncio.sleep(0.01)
        return events

    events = _run(gateway, go)
    final = events[-2]["meta_info"]
    assert final["finish_reason"]["type"] == "abort", final
    assert final["completion_tokens"] < HELD_TOKENS


def test_a_client_that_leaves_the_gateway_is_aborted_on_its_worker(
    gateway: Gateway, workers: list[LiveServer]
) -> None:
    key = 'sluice_request_aborts_total{cause="client_disconnect"}'
    before = sum(metric(w.metrics(), key) for w in workers)

    async def go(client: httpx.AsyncClient) -> None:
        async with _held_stream(client, f"held-{uuid.uuid4().hex}"):
            _holder(workers)  # running on one worker when the client goes

    _run(gateway, go)
    for srv in workers:
        srv.wait_idle(timeout=30)
    assert sum(metric(w.metrics(), key) for w in workers) == before + 1


def test_a_shared_prefix_stays_on_one_worker(gateway: Gateway, workers: list[LiveServer]) -> None:
    """Requests sharing a long prefix all go to the worker of the first, which serves the prefix
    from its radix cache after the first."""
    name, prefix = _name(workers), _fresh_text(150)
    before = [_served(w, "/v1/completions") for w in workers]
    cached = []
    for i in range(4):
        body = {"model": name, "prompt": f"{prefix} question {i}?", "max_tokens": 1}
        resp = httpx.post(f"{gateway.base}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        cached.append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
    served = [_served(w, "/v1/completions") - b for w, b in zip(workers, before, strict=True)]
    assert sorted(served) == [0, 4], served
    # the first can match a token or two of an earlier prompt; the later ones, the prefix
    first = cached[0][0]
    assert first < 8, cached
    assert all(num_cached > first + num_prompt // 2 for num_cached, num_prompt in cached[1:]), (
        cached
    )
