"""A real `python -m sluice serve` for end-to-end tests: start, poll its internal state, stop.

A server started here gets SIGTERM when the test process dies (`die_with_parent`), so a killed
pytest (Ctrl-C twice, the OOM killer) leaves no servers holding gigabytes behind it.

`LiveServer.wait_idle` polls `/get_server_info` until no process holds any request state (with
a deadline) and returns the last internal state, for the no-state-left-behind assertions.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.tiny_models import make_tiny_llama


def long_context_tiny_llama(
    dir: Path, tokenizer_dir: str, max_position_embeddings: int = 16384
) -> str:
    """The tiny Llama with room for `max_position_embeddings` positions, so one request can
    decode for seconds (about 1 ms a token here)."""
    return make_tiny_llama(
        dir, tokenizer_dir=tokenizer_dir, max_position_embeddings=max_position_embeddings
    )


try:  # looked up here, in the parent: a forked child should only make the call
    _prctl = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:
    """A Popen `preexec_fn`: the child gets SIGTERM when the thread that started it ends (the
    fixtures' main thread: so when pytest dies), on Linux; elsewhere nothing."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`model_path` None serves the default model; `num_threads` None leaves the server's own
    choice (the cores available)."""

    def __init__(
        self, model_path: str | None, args: list[str], log: Path, num_threads: int | None = 1
    ) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(self.port), *args]
        if model_path is not None:
            cmd += ["--model-path", model_path]
        if num_threads is not None:
            cmd += ["--num-threads", str(num_threads)]
        with open(log, "w") as f:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
            )
        self.ps = psutil.Process(self.proc.pid)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.base}/health_generate", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log.read_text())

    def state(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.base}/get_server_info", timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.json()["internal_state"]

    def wait_for(self, cond: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Poll until `cond(internal_state)`; a 503 (a scheduler too busy to answer within the
        server's 5 s, on a loaded machine) is polled past like an unmet condition."""
        deadline = time.monotonic() + timeout
        while True:
            resp = httpx.get(f"{self.base}/get_server_info", timeout=10)
            state = resp.json().get("internal_state") if resp.status_code == 200 else resp.text
            if resp.status_code == 200 and cond(state):
                return state
            assert time.monotonic() < deadline, f"condition not reached: {state}"
            time.sleep(0.01)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        return self.wait_for(is_idle, timeout)

    def child(self, title: str) -> psutil.Process:
        kids = self.ps.children(recursive=True)
        return next(p for p in kids if " ".join(p.cmdline()).startswith(title))

    def unready_while_stopped(self, title: str, health_timeout: float) -> dict[str, Any]:
        """SIGSTOP child `title` until /health_generate answers 503 (within health_timeout + 3 s;
        /health stays 200), SIGCONT it, wait until ready again; the 503's error body."""
        child = self.child(title)
        child.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + health_timeout + 3
            while (ready := httpx.get(f"{self.base}/health_generate")).status_code == 200:
                assert time.monotonic() < deadline, f"still ready with {title} stopped"
                time.sleep(0.1)
            assert ready.status_code == 503
            assert httpx.get(f"{self.base}/health", timeout=2).status_code == 200  # liveness
        finally:
            child.send_signal(signal.SIGCONT)
        self.wait_ready(timeout=10)
        return ready.json()["error"]

    def metrics(self) -> str:
        return httpx.get(f"{self.base}/metrics", timeout=10).text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def running_server(
    model_path: str | None, args: list[str], log: Path, num_threads: int | None = 1
) -> Iterator[LiveServer]:
    """A LiveServer, ready, for the block; killed after it (a module fixture's body)."""
    srv = LiveServer(model_path, args, log, num_threads)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def default_chat_server(tmp_path_factory: Any, name: str) -> Iterator[LiveServer]:
    """The default chat model alone (no embedding model), in float32 (outputs are compared
    across batch shapes and with streaming), an 8192-token KV pool, the cores available."""
    args = ["--max-total-tokens", "8192", "--log-level", "warning", "--no-embedding-model",
            "--dtype", "float32"]  # fmt: skip
    with running_server(None, args, tmp_path_factory.mktemp(name) / "server.log", None) as srv:
        yield srv


def is_idle(state: dict[str, Any]) -> bool:
    return (
        state["num_running_reqs"] + state["num_waiting_reqs"] + state["num_req_states"]
        + state["num_detokenizer_states"] + state.get("num_grammar_reqs", 0) == 0
    )  # fmt: skip


def assert_no_state_left(state: dict[str, Any]) -> None:
    assert is_idle(state), state
    pool = state["kv_pool"]
    assert pool["in_use"] == 0 and pool["free"] + pool["cached"] == pool["total"], pool


def metric(text: str, name: str) -> float:
    """The value of one sample line `name ...` of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def set_paused(client: httpx.AsyncClient, paused: bool) -> None:
    """/pause_generation in place, or /continue_generation: while paused no model runs a
    forward step, so every request sent meanwhile stays in flight until the test lets it go."""
    if paused:
        resp = await client.post("/pause_generation", json={"mode": "in_place"})
    else:
        resp = await client.post("/continue_generation")
    assert resp.status_code == 200 and resp.json()["success"], resp.text
