"""Sessions through the real server (all processes, a tiny model with peaked logits):
/open_session and /close_session, turns on /generate and /v1/chat/completions, KV reuse
(cached_tokens), errors, a disconnected turn rolled back, idle expiry. After every test no
process holds request state and every KV slot is free or cached.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.live_server import LiveServer, assert_no_state_left, running_server
from tests.tiny_models import make_tiny_llama

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
CONTEXT_LEN = 16384  # a turn of nearly all of it runs for seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("sessions_e2e")
    model = make_tiny_llama(
        tmp / "model", tokenizer_dir=smollm2_hf_dir, initializer_range=0.5,
        max_position_embeddings=CONTEXT_LEN,
    )  # fmt: skip
    # float32: session turns are compared token for token with plain requests
    args = ["--max-total-tokens", str(CONTEXT_LEN + 1024), "--log-level", "warning",
            "--dtype", "float32"]  # fmt: skip
    with running_server(model, args, tmp / "log") as srv:
        yield srv


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=60) as client:
        yield client
    assert_no_state_left(server.wait_idle())


def _ids(n: int) -> list[int]:
    return [random.randrange(100, 40000) for _ in range(n)]


def _open(http: httpx.Client, **body: Any) -> str:
    resp = http.post("/open_session", json=body)
    assert resp.status_code == 200, resp.text
    sid = resp.json()
    assert isinstance(sid, str) and sid
    return sid


def _generate(http: httpx.Client, ids: list[int], session: dict[str, Any] | None) -> Any:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": GREEDY}
    if session is not None:
        body["session_params"] = session
    return http.post("/generate", json=body)


def _num_sessions(server: LiveServer) -> int:
    return server.state()["num_sessions"]


def test_generate_turns_reuse_the_kv_and_match_a_plain_request(
    http: httpx.Client, server: LiveServer
) -> None:
    sid = _open(http, timeout=60)
    assert _num_sessions(server) == 1
    a, b = _ids(30), _ids(8)
    t1 = _generate(http, a, {"id": sid}).json()
    assert t1["meta_info"]["prompt_tokens"] == len(a)
    t2 = _generate(http, b, {"id": sid}).json()
    full = a + t1["output_ids"] + b
    assert t2["meta_info"]["prompt_tokens"] == len(full)
    assert t2["meta_info"]["cached_tokens"] == len(full) - len(b) - 1
    assert http.post("/flush_cache").status_code == 200
    plain = _generate(http, full, None).json()
    assert plain["meta_info"]["cached_tokens"] == 0
    assert t2["output_ids"] == plain["output_ids"]
    # a splice at offset 10 of the first turn
    t3 = _generate(http, b, {"id": sid, "rid": t1["meta_info"]["id"], "offset": 10}).json()
    assert t3["meta_info"]["prompt_tokens"] == 10 + len(b)
    assert http.post("/close_session", json={"session_id": sid}).json() == {"success": True}
    assert _num_sessions(server) == 0


def test_chat_turns(http: httpx.Client, server: LiveServer) -> None:
    sid = _open(http, session_id="chat-1", capacity_of_str_len=1000)
    assert sid == "chat-1"
    extra = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    hi = [{"role": "user", "content": "Hello there"}]
    more = [{"role": "user", "content": "Tell me more"}]

    def chat(messages: list[dict[str, str]], session: dict[str, Any] | None) -> dict[str, Any]:
        body = {"messages": messages, **extra}
        if session is not None:
            body["session_params"] = session
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    u1 = chat(hi, {"id": sid})
    u2 = chat(more, {"id": sid})
    alone = chat(more, None)  # the second turn's own templated prompt
    context = u1["prompt_tokens"] + u1["completion_tokens"]
    assert u2["prompt_tokens"] == context + alone["prompt_tokens"]
    assert u2["prompt_tokens_details"]["cached_tokens"] == context - 1
    http.post("/close_session", json={"session_id": sid})
    resp = http.post("/v1/chat/completions", json={"messages": more, "session_params": {"id": sid}})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_session"


def test_session_errors_are_400(http: httpx.Client) -> None:
    resp = _generate(http, _ids(4), {"id": "never-opened"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_session"
    assert "not open" in resp.json()["error"]["message"]
    sid = _open(http, session_id="dup")
    resp = http.post("/open_session", json={"session_id": "dup"})
    assert resp.status_code == 400 and "already open" in resp.json()["error"]["message"]
    resp = _generate(http, _ids(4), {"id": sid, "rid": "no-such-rid"})
    assert resp.status_code == 400 and "no-such-rid" in resp.json()["error"]["message"]
    resp = _generate(http, _ids(4), {"id": sid, "offset": "x"})
    assert resp.status_code == 400
    resp = http.post(
        "/generate",
        json={"input_ids": [_ids(4), _ids(4)], "session_params": {"id": sid}},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "session_params"
    http.post("/close_session", json={"session_id": sid})


def test_disconnected_turn_is_rolled_back(http: httpx.Client, server: LiveServer) -> None:
    """The turn runs (its first update arrived), then generation is paused, so it cannot finish
    before its client leaves: the disconnect ends it, and the session forgets it."""
    sid = _open(http)
    a, b, c = _ids(20), _ids(5), _ids(5)
    t1 = _generate(http, a, {"id": sid}).json()
    long = {"temperature": 0, "ignore_eos": True, "max_new_tokens": CONTEXT_LEN - 64}
    body = {"input_ids": b, "sampling_params": long, "stream": True, "session_params": {"id": sid}}
    try:
        with http.stream("POST", "/generate", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):  # the first update arrived: the turn runs
                    paused = http.post("/pause_generation", json={"mode": "in_place"})
                    assert paused.status_code == 200, paused.text
                    state = server.wait_for(lambda s: s["paused"])
                    assert state["num_running_reqs"] == 1, state  # held, not finished
                    break  # leaving the stream closes its connection: a disconnect
        server.wait_idle()  # the disconnect is taken in while paused
    finally:
        assert http.post("/continue_generation").status_code == 200
    t3 = _generate(http, c, {"id": sid}).json()
    assert t3["meta_info"]["prompt_tokens"] == len(a) + len(t1["output_ids"]) + len(c)
    http.post("/close_session", json={"session_id": sid})


def test_idle_session_expires(http: httpx.Client, server: LiveServer) -> None:
    sid = _open(http, timeout=0.5)
    assert _generate(http, _ids(4), {"id": sid}).status_code == 200
    deadline = time.monotonic() + 5
    while _num_sessions(server) > 0:
        assert time.monotonic() < deadline, "the session did not expire"
        time.sleep(0.1)
    resp = _generate(http, _ids(4), {"id": sid})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_session"
