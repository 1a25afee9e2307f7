"""The CUDA path: what CPU-only runs cannot check, against the same code on the CPU.

The SDPA kernel choice is checked everywhere; the rest is skipped where there is no CUDA device
(`scripts/device/` runs it on a lent GPU machine, with test_parity.py's CUDA variants).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from sluice.model.layers import cuda_sdpa_backends
from tests.model.test_parity import CUDA, Driver, _prompts, assert_agree_in_bfloat16


def test_cuda_sdpa_backends_leave_cudnn_out_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("SLUICE_CUDA_SDPA", raising=False)
    assert cuda_sdpa_backends() == [
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
    ]  # fmt: skip
    monkeypatch.setenv("SLUICE_CUDA_SDPA", " cudnn, math ")
    assert cuda_sdpa_backends() == [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    for bad in ("flash,fast", ""):
        monkeypatch.setenv("SLUICE_CUDA_SDPA", bad)
        with pytest.raises(ValueError, match="comma-separated list of cudnn, flash"):
            cuda_sdpa_backends()


@CUDA
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_bfloat16_on_cuda_agrees_with_the_cpu(model, tiny_llama_dir, tiny_qwen2_dir) -> None:
    """bfloat16 runs SDPA's fused kernels on CUDA; within bfloat16's precision they must give
    the CPU's logits, prefill of prompts of different lengths and decode."""
    path = tiny_llama_dir if model == "llama" else tiny_qwen2_dir
    cpu, cuda = (Driver(path, False, torch.bfloat16, device=d) for d in ("cpu", "cuda"))
    assert_agree_in_bfloat16(cpu, cuda, seed=6)


@CUDA
def test_prompt_and_output_logprobs_on_cuda_match_the_cpu(tiny_llama_dir) -> None:
    from sluice import Engine

    prompt = _prompts(7, [40])[0]
    params = {"max_new_tokens": 6, "temperature": 0}
    outs = []
    for device in ("cpu", "cuda"):
        engine = Engine(tiny_llama_dir, device=device, dtype="float32", max_total_tokens=2048)
        logprobs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
        outs.append(engine.generate(input_ids=prompt, sampling_params=params, **logprobs))
        engine.shutdown()
    cpu, cuda = outs
    assert cuda["output_ids"] == cpu["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        want, got = cpu["meta_info"][key], cuda["meta_info"][key]
        assert len(got) == len(want) and (got[0] is None) == (want[0] is None)
        pairs = [(a, b) for a, b in zip(got, want, strict=True) if b is not None]
        assert max(abs(a - b) for a, b in pairs) < 1e-4
