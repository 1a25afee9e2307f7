"""Loading the tokenizer of a model directory (Hugging Face layout, see sluice.checkpoint.hf_dir)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=8)
def _load(hf_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir, use_fast=True)


def get_tokenizer(hf_dir: str) -> Any:
    """The fast tokenizer of `hf_dir`, loaded once per directory per process.

    The returned object is shared: callers must not mutate it (e.g. its chat template).
    """
    return _load(str(Path(hf_dir).resolve()))
