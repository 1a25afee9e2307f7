"""A mixed step (a prompt's chunk and running requests' decode tokens in one forward) computes
what the same requests compute in separate forwards: the logits of each row do not depend on
which other requests share the batch, whichever attention backend takes it.

Runs the tiny Llama in float32 through `ModelRunner` on hand-built `ForwardBatch`es, with the
scheduler left out (its mixed steps are tests/scheduler/test_engine.py's).
"""

from __future__ import annotations

import pytest
import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.model import kernels
from sluice.model.attention import pick_backend
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.layers import PagedAttention
from sluice.model.runner import ModelRunner

CPU = torch.device("cpu")
ROW_SLOTS = 100  # request b owns slots 1 + b * ROW_SLOTS ...: slot 0 stays the padding slot
DECODE_PREFIXES = [7, 12, 30]  # the running requests' tokens in the pool before this step


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: str) -> ModelRunner:
    assert kernels.cpu_ops() is not None, "the CPU kernels did not build (see the warning log)"
    return ModelRunner(ModelConfig.from_hf_dir(tiny_llama_dir), CPU, torch.float32, kv_size=512)


def _forward(runner, mode, reqs, prefix_lens, extend_lens, tokens) -> tuple[torch.Tensor, str]:
    """Logits [B, vocab] of each request's last new token (`tokens[b]`: request b's ids), and
    the attention backend that took the batch."""
    req_to_token = 1 + torch.arange(len(tokens))[:, None] * ROW_SLOTS + torch.arange(ROW_SLOTS)
    ids, slots, last = [], [], []
    for b, p, e in zip(reqs, prefix_lens, extend_lens, strict=True):
        ids.extend(tokens[b][p : p + e])
        slots.append(req_to_token[b, p : p + e])
        last.append(len(ids) - 1)
    fb = ForwardBatch.build(
        mode, ids, prefix_lens, extend_lens, torch.cat(slots), req_to_token, reqs, last, CPU
    )
    return runner.forward(fb), pick_backend(_backends(runner), fb).name


def _backends(runner: ModelRunner):
    return next(m for m in runner.model.modules() if isinstance(m, PagedAttention)).backends


# (the arriving request's prefix in the pool, its new tokens): few queries a request, or a
# mask the decoding rows keep sparse: the kernels take every one of these batches
ARRIVALS = {
    "a-cached-prompts-last-token": (39, 1),  # every request brings one query
    "a-short-chunk-on-a-prefix": (30, 10),
    "a-fresh-prompt": (0, 40),
    "a-long-chunk-on-a-prefix": (10, 60),
}


@pytest.mark.parametrize("sdpa_only", [False, True])
@pytest.mark.parametrize("arrival", ARRIVALS)
def test_a_mixed_batch_gives_each_request_the_logits_it_gets_apart(
    runner: ModelRunner, arrival: str, sdpa_only: bool
) -> None:
    new_prefix, new_len = ARRIVALS[arrival]
    attention = [m for m in runner.model.modules() if isinstance(m, PagedAttention)]
    ops = attention[0].cpu_ops
    try:
        for m in attention if sdpa_only else ():
            m.cpu_ops = None
        backend = _check_mixed_against_apart(runner, new_prefix, new_len)
    finally:
        for m in attention:
            m.cpu_ops = ops
    assert backend == ("sdpa" if sdpa_only else "cpu-kernels")


def _check_mixed_against_apart(runner: ModelRunner, new_prefix: int, new_len: int) -> str:
    """Asserts the mixed batch's logits are those of its parts apart; the mixed batch's backend."""
    gen = torch.Generator().manual_seed(new_prefix + new_len)
    vocab = runner.cfg.vocab_size
    lens = [*(p + 1 for p in DECODE_PREFIXES), new_prefix + new_len]
    tokens = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]
    new = len(DECODE_PREFIXES)  # the arriving request's index; 0.. decode
    # the pool first holds every request's prefix, each written by a forward of its own
    for b, p in enumerate([*DECODE_PREFIXES, new_prefix]):
        if p:
            _forward(runner, ForwardMode.EXTEND, [b], [0], [p], tokens)
    decoding = list(range(new))
    ones = [1] * new
    mixed, backend = _forward(
        runner, ForwardMode.EXTEND, [new, *decoding], [new_prefix, *DECODE_PREFIXES],
        [new_len, *ones], tokens,
    )  # fmt: skip
    alone, _ = _forward(runner, ForwardMode.EXTEND, [new], [new_prefix], [new_len], tokens)
    decoded, _ = _forward(runner, ForwardMode.DECODE, decoding, DECODE_PREFIXES, ones, tokens)
    torch.testing.assert_close(mixed[0], alone[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(mixed[1:], decoded, atol=1e-4, rtol=0)
    assert torch.equal(mixed.argmax(-1), torch.cat([alone, decoded]).argmax(-1))
    return backend
