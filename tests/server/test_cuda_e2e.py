"""The real server (all processes) on a CUDA device, with the default model in its default dtype
there (bfloat16). Skipped where there is no CUDA device; `scripts/device/` runs it on a lent GPU
machine. Greedy chat streamed and not, a concurrent batch, then no state left behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from tests.server.live_server import LiveServer, assert_no_state_left, running_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DEVICE = "cuda"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = ["--device", DEVICE, "--max-total-tokens", "16384", "--no-embedding-model",
            "--log-level", "warning"]  # fmt: skip
    log = tmp_path_factory.mktemp("cuda_e2e") / "server.log"
    with running_server(None, args, log, num_threads=None) as srv:
        yield srv


def _body(content: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, **extra}


def _chat(srv: LiveServer, content: str) -> dict[str, Any]:
    resp = httpx.post(f"{srv.base}/v1/chat/completions", json=_body(content), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_model_runs_on_the_device_in_its_default_dtype(server: LiveServer) -> None:
    state = server.state()  # what the scheduler resolved at start-up, not the argument
    assert state["device"].startswith(DEVICE), state
    assert state["dtype"] == ("bfloat16" if DEVICE == "cuda" else "float32"), state


def test_streamed_greedy_chat_equals_the_full_response(server: LiveServer) -> None:
    _chat(server, "Name three colors of the rainbow.")
    # now the prompt is cached: this one and the streamed one run the same shapes, so the same
    # bfloat16 roundings (the first, from scratch, may differ from them at a near-tie)
    full = _chat(server, "Name three colors of the rainbow.")
    text = full["choices"][0]["message"]["content"]
    assert text and 0 < full["usage"]["completion_tokens"] <= MAX_TOKENS
    body = _body("Name three colors of the rainbow.", stream=True)
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == text
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_concurrent_requests_all_complete(server: LiveServer) -> None:
    prompts = [f"Count from {i} to {i + 5}, separated by commas." for i in range(16)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: _chat(server, p), prompts))
    for out in outs:
        assert out["choices"][0]["message"]["content"]
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
        assert 0 < out["usage"]["completion_tokens"] <= MAX_TOKENS


def test_no_state_left_behind(server: LiveServer) -> None:
    assert_no_state_left(server.wait_idle())
