"""The real server (all processes) through the official `openai` SDK and raw HTTP.

The session's shared default chat server (`default_chat`, tests/server/conftest.py), a real
`python -m sluice serve` on a free port; the last test checks that it is idle with every KV slot
free or cached and no request state left behind.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from tests.server.live_server import LiveServer

pytest.importorskip("sluice.launch", reason="sluice.launch is not there yet")
openai = pytest.importorskip("openai")

MAX_TOTAL_TOKENS = 8192
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


@pytest.fixture(scope="module")
def server(default_chat: LiveServer) -> str:
    """The shared default chat server: float32 (greedy texts are compared across batch shapes,
    32 concurrent streams), a MAX_TOTAL_TOKENS pool, no embedding model."""
    return default_chat.base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_greedy_chat_equals_engine(client, model) -> None:
    from sluice import Engine

    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=24
    )
    with Engine(max_total_tokens=MAX_TOTAL_TOKENS, dtype="float32") as engine:  # as the server
        prompt = engine.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=False
        )
        ref = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    assert resp.choices[0].message.content == ref["text"]
    assert resp.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_concatenation_equals_non_stream(client, model) -> None:
    kw = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_cjk_and_emoji_stream_without_replacement_char(server, model) -> None:
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": 20,
            "messages": [{"role": "user", "content": "Repeat exactly: 你好世界 🎉🚀 こんにちは"}]}  # fmt: skip
    raw = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).content.decode()
    text = "".join(
        json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
        for f in raw.split("\n\n") if f.startswith("data: {")
    )  # fmt: skip
    assert "\ufffd" not in text
    # completions: streamed == non-streamed; a U+FFFD may only end a text cut at max_tokens
    # in the middle of a character (the model's choice, not a streaming artifact)
    prompt = {"model": model, "prompt": "你好世界 🎉🚀", "max_tokens": 12, "temperature": 0}
    full = httpx.post(f"{server}/v1/completions", json=prompt, timeout=60).json()
    raw = httpx.post(f"{server}/v1/completions", json={**prompt, "stream": True}, timeout=60)
    frames = [f for f in raw.content.decode().split("\n\n") if f.startswith("data: {")]
    streamed = "".join(json.loads(f[6:])["choices"][0]["text"] for f in frames)
    assert streamed == full["choices"][0]["text"]
    assert "\ufffd" not in streamed.rstrip("\ufffd")


def test_stop_string_never_leaks(client, model) -> None:
    kw = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    full = client.chat.completions.create(**kw).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stop=[stop], stream=True)
    )
    assert streamed == full[: full.index(stop)]
    assert not any(streamed.endswith(stop[:k]) for k in range(2, len(stop) + 1))


def test_n3_choices(client, model) -> None:
    resp = client.chat.completions.create(model=model, messages=MESSAGES, n=3, max_tokens=8, seed=1)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)


def test_32_concurrent_streams(server, client, model) -> None:
    def kwargs(i: int) -> dict:
        content = f"Count from {i % 4} to {i % 4 + 5}."
        return {"model": model, "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip

    refs = [
        client.chat.completions.create(**kwargs(i)).choices[0].message.content for i in range(4)
    ]

    async def one(ac: openai.AsyncOpenAI, i: int) -> str:
        text, reasons = "", []
        async for c in await ac.chat.completions.create(**kwargs(i), stream=True):
            text += c.choices[0].delta.content or ""
            reasons.append(c.choices[0].finish_reason)
        assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
        return text

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    texts = asyncio.run(main())
    assert texts == [refs[i % 4] for i in range(32)]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [(b"{oops", 400, "invalid_json"),
     (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, None),
     (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}', 400, None),
     (b'{"messages": [{"role": "user", "content": "x"}], "model": "nope"}', 404, "model_not_found")],
)  # fmt: skip
def test_bad_requests_then_still_serving(server, client, model, body, status, code) -> None:
    resp = httpx.post(f"{server}/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert code is None or err["code"] == code
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].message.content


def test_too_long_prompt_is_400(client, model) -> None:
    ctx = client.models.list().data[0].model_extra["context_length"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hello " * (ctx + 10), max_tokens=4)
    assert isinstance(info.value.body, dict) and isinstance(info.value.code, str)


def test_zz_idle_state_clean(server) -> None:
    deadline = time.monotonic() + 10
    while True:
        state = httpx.get(f"{server}/get_server_info", timeout=10).json()["internal_state"]
        idle = state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
        if idle and state["num_req_states"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and state["num_req_states"] == 0 and state["num_detokenizer_states"] == 0
    assert state["kv_free"] + state["kv_cached"] == state["kv_total"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert (state["device"], state["dtype"]) == (device, "float32")
