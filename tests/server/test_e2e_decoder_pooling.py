"""The chat model (a decoder) as an embedder, a label-token scorer (/v1/score) and a reranker,
through one real `sluice serve` of the default SmolLM2 model, with the default embedding model
next to it when it is installed (so that routing by `model` is exercised both ways)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from sluice.checkpoint.encoder_config import DEFAULT_EMBEDDING_NAME, default_embedding_model_path
from tests.server.live_server import (
    LiveServer,
    assert_no_state_left,
    metric,
    running_server,
    set_paused,
)

openai = pytest.importorskip("openai")

HAS_EMBEDDER = default_embedding_model_path() is not None
TEXTS = [
    "The cat sat on the mat.",
    "Quantum computers use qubits.",
    "Paris is the capital of France.",
    "I like green apples",
]
HIDDEN_SIZE = 576  # SmolLM2-135M
needs_embedder = pytest.mark.skipif(not HAS_EMBEDDER, reason="no default embedding model")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("decoder_pooling")
    # float32: vectors and scores are compared across requests and with greedy generation
    args = ["--log-level", "warning", "--dtype", "float32",
            *([] if HAS_EMBEDDER else ["--no-embedding-model"])]  # fmt: skip
    with running_server(None, args, tmp / "server.log", num_threads=None) as srv:
        yield srv


@pytest.fixture(scope="module")
def base(server: LiveServer) -> str:
    return server.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def chat_model(client: openai.OpenAI) -> str:
    return next(m.id for m in client.models.list().data if m.model_extra["task"] == "generate")


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _score(base: str, **body: object) -> httpx.Response:
    return httpx.post(f"{base}/v1/score", json=body, timeout=60)


def _embed(client: openai.OpenAI, model: str, inputs: list[str]) -> list[np.ndarray]:
    out = client.embeddings.create(model=model, input=inputs, encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(inputs)))
    return [np.array(d.embedding) for d in out.data]


def test_the_chat_models_card_lists_its_tasks(client: openai.OpenAI, chat_model: str) -> None:
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards[chat_model]["task"] == "generate"
    assert cards[chat_model]["tasks"] == ["generate", "embed", "score", "rerank"]
    if HAS_EMBEDDER:
        assert cards[DEFAULT_EMBEDDING_NAME]["task"] == "embed"


def test_decoder_embeddings_float_and_base64(client: openai.OpenAI, chat_model: str) -> None:
    floats = client.embeddings.create(model=chat_model, input=TEXTS, encoding_format="float")
    assert floats.model == chat_model
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    packed = client.embeddings.create(model=chat_model, input=TEXTS)  # the SDK asks for base64
    for f, p in zip(floats.data, packed.data, strict=True):
        vec = np.array(f.embedding)
        assert vec.shape == (HIDDEN_SIZE,) and abs(np.linalg.norm(vec) - 1) < 1e-4
        assert _cos(vec, np.array(p.embedding)) >= 0.9999


def test_raw_base64_is_little_endian_float32(base: str, chat_model: str) -> None:
    body = {"model": chat_model, "input": TEXTS[0], "encoding_format": "base64"}
    data = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60).json()["data"]
    vec = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    assert vec.shape == (HIDDEN_SIZE,) and abs(np.linalg.norm(vec) - 1) < 1e-4


def test_a_batch_equals_each_input_alone_in_order(client: openai.OpenAI, chat_model: str) -> None:
    batch = _embed(client, chat_model, TEXTS)
    alone = [_embed(client, chat_model, [t])[0] for t in TEXTS]
    for i, vec in enumerate(batch):
        sims = [_cos(vec, a) for a in alone]
        assert sims[i] >= 0.9999 and int(np.argmax(sims)) == i, sims


def test_token_ids_embed_like_their_text(client: openai.OpenAI, base: str, chat_model) -> None:
    ids = httpx.post(f"{base}/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = client.embeddings.create(model=chat_model, input=[ids], encoding_format="float")
    by_text = _embed(client, chat_model, [TEXTS[1]])[0]
    assert _cos(np.array(by_ids.data[0].embedding), by_text) >= 0.9999


def test_without_model_the_embedding_model_is_preferred(base: str, chat_model: str) -> None:
    out = httpx.post(f"{base}/v1/embeddings", json={"input": "hi"}, timeout=60).json()
    assert out["model"] == (DEFAULT_EMBEDDING_NAME if HAS_EMBEDDER else chat_model)


def test_score_probabilities_both_ways(base: str, chat_model: str) -> None:
    labels = [10407, 4607, 9805]  # "yes", "no", " yes" in SmolLM2's vocabulary
    body = {"query": "Is Paris in France? Answer:", "items": [" yes", " no", " maybe"],
            "label_token_ids": labels}  # fmt: skip
    raw = _score(base, model=chat_model, **body).json()
    assert raw["object"] == "scoring" and raw["model"] == chat_model
    assert raw["usage"]["prompt_tokens"] == raw["usage"]["total_tokens"] > 0
    soft = _score(base, **body, apply_softmax=True).json()  # no model: the decoder scores
    assert len(raw["scores"]) == len(soft["scores"]) == 3
    for r, s in zip(raw["scores"], soft["scores"], strict=True):
        assert len(r) == len(s) == len(labels)
        assert all(0 <= p <= 1 for p in r) and sum(r) <= 1 + 1e-6
        assert abs(sum(s) - 1) < 1e-5
        assert np.allclose(s, np.array(r) / sum(r), rtol=1e-3, atol=1e-6)


def test_score_agrees_with_greedy_generation(base: str) -> None:
    """The token /generate picks greedily is the label /v1/score ranks highest, and their
    log-probabilities match."""
    prompt = "The capital of France is"
    gen = httpx.post(f"{base}/generate", timeout=60, json={
        "text": prompt, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }).json()  # fmt: skip
    top = gen["meta_info"]["output_top_logprobs"][0]  # [[logprob, id], ...], best first
    labels = [int(top[1][1]), int(top[0][1])]  # the runner-up first: order must not matter
    assert gen["output_ids"][0] == labels[1]
    scores = _score(base, query=prompt, items=[""], label_token_ids=labels).json()["scores"][0]
    assert scores[1] > scores[0]
    for p, (lp, _) in zip(scores, [top[1], top[0]], strict=True):
        assert abs(np.log(p) - lp) < 1e-2


def test_score_token_ids_and_item_first(base: str) -> None:
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "Paris is in"}).json()["tokens"]
    labels = [10407, 4607]
    by_ids = _score(base, query=ids[:1], items=[ids[1:]], label_token_ids=labels).json()
    flipped = _score(
        base, query=ids[1:], items=[ids[:1]], item_first=True, label_token_ids=labels
    ).json()
    by_text = _score(base, query="Paris is in", items=[""], label_token_ids=labels).json()
    assert np.allclose(by_ids["scores"], flipped["scores"], rtol=1e-3)
    assert np.allclose(by_ids["scores"], by_text["scores"], rtol=1e-3)


def test_rerank_by_the_decoder(base: str, chat_model: str) -> None:
    docs = ["Paris is the capital of France.", {"text": "Bananas are yellow."}, "Cats purr."]
    body = {"model": chat_model, "query": "What is the capital of France?", "documents": docs}
    out = httpx.post(f"{base}/v1/rerank", json=body, timeout=60).json()
    assert out["method"] == "decoder-yes-no" and out["model"] == chat_model
    assert sorted(r["index"] for r in out["results"]) == [0, 1, 2]
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert out["usage"]["total_tokens"] > 0
    top = httpx.post(f"{base}/rerank", json={**body, "top_n": 1}, timeout=60).json()
    assert len(top["results"]) == 1 and top["results"][0]["index"] == out["results"][0]["index"]
    assert abs(top["results"][0]["relevance_score"] - scores[0]) < 1e-4


@needs_embedder
def test_rerank_without_model_prefers_the_embedding_model(base: str) -> None:
    body = {"query": "capital of France", "documents": ["Paris.", "Bananas."]}
    assert httpx.post(f"{base}/v1/rerank", json=body, timeout=60).json()["method"] == "cosine"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"items": []}, 400, "items"),
        ({"label_token_ids": []}, 400, "label_token_ids"),
        ({"label_token_ids": None}, 400, "label_token_ids"),
        ({"label_token_ids": [49152]}, 400, "label_token_ids"),
        ({"label_token_ids": [-1]}, 400, "label_token_ids.0"),  # the dotted location
        ({"items": [[1, 2]]}, 400, "items"),
        ({"query": [1, 2], "items": ["text"]}, 400, "items"),
        ({"items": [[1, 99999]], "query": [1]}, 400, "items"),
        ({"model": "nope"}, 404, "model"),
    ],
)
def test_bad_score_requests_are_4xx(base: str, body, status, param) -> None:
    resp = _score(base, **{"query": "Is it?", "items": [" yes"], "label_token_ids": [1], **body})
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
    if status == 404:
        names = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert all(n in resp.json()["error"]["message"] for n in names)


@needs_embedder
def test_score_by_an_encoder_is_refused(base: str) -> None:
    resp = _score(base, model=DEFAULT_EMBEDDING_NAME, query="q", items=["a"], label_token_ids=[1])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"


def test_too_long_inputs_quote_the_context_length(base: str, chat_model: str) -> None:
    info = httpx.get(f"{base}/v1/models/{chat_model}").json()
    resp = _score(base, query="word " * (info["context_length"] + 10), items=[""],
                  label_token_ids=[1])  # fmt: skip
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (
        error["code"] == "context_length_exceeded" and "maximum context length" in error["message"]
    )
    body = {"model": chat_model, "input": "hi", "dimensions": HIDDEN_SIZE + 1}
    resp = httpx.post(f"{base}/v1/embeddings", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "dimensions"


def test_a_client_that_goes_away_leaves_nothing_behind(server: LiveServer, chat_model) -> None:
    """Paused, the call's 16 inputs wait in the scheduler until its client goes away: each is
    counted once as a disconnect, and no state is left, already while paused (aborts are
    taken in then)."""
    disconnects = 'sluice_request_aborts_total{cause="client_disconnect"}'
    counted_before = metric(server.metrics(), disconnects)
    body = {"model": chat_model, "input": ["word " * 400] * 16}

    def all_queued(state: dict[str, Any]) -> bool:
        return state["paused"] and state["num_waiting_reqs"] == 16

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            await set_paused(client, True)
            try:
                call = asyncio.create_task(client.post("/v1/embeddings", json=body))
                await asyncio.to_thread(server.wait_for, all_queued, 30)
                call.cancel()  # the client goes away: its connection closes
                await asyncio.gather(call, return_exceptions=True)
                await asyncio.to_thread(server.wait_idle, 30)
            finally:
                await set_paused(client, False)

    asyncio.run(go())
    assert_no_state_left(server.wait_idle())
    assert metric(server.metrics(), disconnects) - counted_before == 16


def test_after_everything_the_server_serves_and_holds_nothing(
    server: LiveServer, client: openai.OpenAI, chat_model: str
) -> None:
    out = client.chat.completions.create(
        model=chat_model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].message.content is not None
    assert_no_state_left(server.wait_idle())
