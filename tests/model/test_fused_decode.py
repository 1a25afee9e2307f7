"""The fused decode path (sluice.model.fused_decode, cpu_ops.cpp's DecodeLayers) against the
per-op path it stands in for, and where it is and is not taken.

DecodeLayers runs the per-op path's own kernels in the same order on the same values, so the two
paths' logits are compared for equality, not closeness: in float32 and in bfloat16 (where the
linear layers take the integer path, on AVX-512 VNNI builds in their row-interleaved layout,
which both paths then read), with Q4_1 and Q8_0 blocks, over a prefill and several
decode steps of two requests of different lengths, each step run by both paths on the same KV
state; then through the Engine on the default SmolLM2 GGUF, greedy tokens and logprobs.
"""

from __future__ import annotations

import sys

import pytest
import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.attention import CpuKernelAttention
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.fused_decode import FusedDecode, why_not_fused
from sluice.model.kernels import cpu_ops, quant_ops
from sluice.model.kv_cache import KVCache
from sluice.model.layers import PackedLinear
from sluice.model.quant import QuantLinear
from sluice.model.runner import ModelRunner

CPU = torch.device("cpu")
PROMPTS = [[101, 102, 103, 104, 105], [201, 202, 203]]
SLOTS_PER_REQ = 32


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if quant_ops() is None:
        pytest.skip("the quantized-weight kernels did not build here")


def _runner(
    model_dir: str, dtype: torch.dtype, quantization: str, requests: int = 9
) -> ModelRunner:
    """A runner whose KV pool holds `requests` of `_batch`'s requests."""
    cfg = ModelConfig.from_hf_dir(model_dir)
    return ModelRunner(
        cfg, CPU, dtype, kv_size=(requests + 1) * SLOTS_PER_REQ, quantization=quantization
    )


def _batch(
    mode: ForwardMode,
    tokens: list[list[int]],
    prefix_lens: list[int],
    shared: int = 0,
    outsiders: int = 0,
) -> ForwardBatch:
    """Request b's tokens at positions prefix_lens[b].., in its own slots 1 + b * 32 + position;
    the first `shared` positions of every request but the last `outsiders` in request 0's slots
    (a prefix held once)."""
    num = len(tokens)
    req_to_token = 1 + torch.arange(num * SLOTS_PER_REQ).view(num, SLOTS_PER_REQ)
    req_to_token[: num - outsiders, :shared] = req_to_token[0, :shared].clone()
    extend = [len(t) for t in tokens]
    loc = torch.cat(
        [
            req_to_token[b, p : p + e]
            for b, (p, e) in enumerate(zip(prefix_lens, extend, strict=True))
        ]
    )
    last = torch.cumsum(torch.tensor(extend), 0) - 1
    return ForwardBatch.build(
        mode, [t for ts in tokens for t in ts], prefix_lens, extend, loc, req_to_token,
        list(range(num)), last.tolist(), CPU,
    )  # fmt: skip


def _interleaved(model: torch.nn.Module) -> list[bool]:
    """For each QuantLinear of `model`: whether its blocks are in the row-interleaved layout."""
    return [m.kernel_type != m.qtype for m in model.modules() if isinstance(m, QuantLinear)]


def _both_ways(runner: ModelRunner, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused logits, per-op logits) of one batch: fused first, then per-op over the same slots
    (which it rewrites with the same K/V)."""
    fused = runner.fused_decode
    fused.enabled = True
    with_fused = runner.forward(fb)
    fused.enabled = False
    per_op = runner.forward(fb)
    fused.enabled = True
    return with_fused, per_op


def _decode_both_ways(
    runner: ModelRunner, steps: int, prompts: list[list[int]] = PROMPTS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`_both_ways` of the prefill of `prompts` (an extend of a few queries a request: the
    kernels' attention takes it, so the fused path does too) and of each decode step after it;
    each step feeds on the per-op path's argmax."""
    pairs = [_both_ways(runner, _batch(ForwardMode.EXTEND, prompts, [0] * len(prompts)))]
    lens = [len(p) for p in prompts]
    for _ in range(steps):
        tokens = [[t] for t in pairs[-1][1].argmax(-1).tolist()]
        pairs.append(_both_ways(runner, _batch(ForwardMode.DECODE, tokens, lens)))
        lens = [n + 1 for n in lens]
    return pairs


def _max_rows(runner: ModelRunner) -> int:
    """The rows the fused decode should take: any number where the decoder's linear layers
    compute batches past the block kernel's rows with the integer GEMM on repacked blocks, or
    (bfloat16 on CPUs with AMX) with their float copy's AMX copy (which DecodeLayers calls
    too); where a float copy without one takes some batches (past the block kernel's 8 rows),
    the rows of that copy's oneDNN path, which DecodeLayers calls too."""
    modules = [m for m in runner.model.model.layers.modules() if isinstance(m, QuantLinear)]
    copies = [m.dense for m in modules if m.dense is not None]
    assert all(isinstance(c, PackedLinear) for c in copies)
    if all(c.amx is not None and c.dtype == torch.bfloat16 for c in copies):
        return sys.maxsize  # every batch past oneDNN's rows takes the AMX copies
    return PackedLinear.PACKED_MAX_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int4", "int8"])  # Q4_1, Q8_0 blocks
def test_fused_decode_gives_the_per_op_logits_exactly(tiny_llama_dir, dtype, quantization) -> None:
    runner = _runner(tiny_llama_dir, dtype, quantization)
    fused = runner.fused_decode
    assert isinstance(fused, FusedDecode)
    assert fused.max_rows == _max_rows(runner)
    # bfloat16 rows take the integer path: every layer interleaved, where the build has it
    interleaved = dtype == torch.bfloat16 and bool(quant_ops().interleaved_types)
    assert set(_interleaved(runner.model)) == {interleaved}
    pairs = _decode_both_ways(runner, steps=6)
    assert fused.steps == 7  # the prefill and the decode steps, each once (enabled)
    for with_fused, per_op in pairs:
        assert with_fused.dtype == torch.float32 and with_fused.shape == per_op.shape
        assert torch.equal(with_fused, per_op)
    assert len({tuple(p.argmax(-1).tolist()) for _, p in pairs}) > 1  # the tokens move on


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_fused_decode_of_a_large_batch_gives_the_per_op_logits_exactly(
    tiny_llama_dir, quantization
) -> None:
    """Past the block kernel's 8 rows, where the linear layers take the integer GEMM on
    repacked blocks (bfloat16 on AVX-512 VNNI CPUs; with AMX up to 16 rows, or 32 without an
    AMX copy) or a float copy (elsewhere), DecodeLayers calls it too."""
    runner = _runner(tiny_llama_dir, torch.bfloat16, quantization)
    prompts = [[100 + 7 * b + i for i in range(1 + b % 5)] for b in range(10)]  # 10 requests
    pairs = _decode_both_ways(runner, steps=4, prompts=prompts)
    assert runner.fused_decode.steps == 5
    for with_fused, per_op in pairs:
        assert with_fused.shape == (10, per_op.shape[1])
        assert torch.equal(with_fused, per_op)


@pytest.mark.parametrize(
    "dtype,rows",
    [(torch.float32, 12), (torch.bfloat16, 20), (torch.bfloat16, 40), (torch.bfloat16, 80)],
)
def test_fused_decode_of_a_float_copys_batch_gives_the_per_op_logits_exactly(
    tiny_llama_dir, dtype, rows
) -> None:
    """A batch the linear layers give their float copy (float32 past the block kernel's 8 rows;
    bfloat16 past AMX_PACKED_MAX_ROWS on CPUs with AMX, also past oneDNN's 64 rows there):
    DecodeLayers calls oneDNN's GEMM on the weight PackedLinear reordered, through the op
    PackedLinear calls, or (bfloat16) the AMX GEMM on that copy's AMX copy, a gate_up's with
    its SiLU, so the logits are the per-op path's bit for bit."""
    runner = _runner(tiny_llama_dir, dtype, "int4", requests=rows)
    layers = [m for m in runner.model.model.modules() if isinstance(m, QuantLinear)]
    dense = [m for m in layers if m.dense is not None and m.dense_min_rows <= rows]
    if dtype == torch.float32:
        assert dense == layers
    elif not dense:
        pytest.skip(f"bfloat16 batches of {rows} rows take the integer GEMM on this CPU (no AMX)")
    assert all(isinstance(m.dense, PackedLinear) for m in dense)
    amx = cpu_ops() is not None and cpu_ops().amx_linear_ok()
    if rows > PackedLinear.PACKED_MAX_ROWS and not amx:
        pytest.skip(f"{rows} rows are past oneDNN's copy's, which the fused decode then leaves")
    if dtype == torch.bfloat16 and amx:  # every layer's copy has its AMX copy, gate_ups paired
        assert all(m.dense.amx is not None for m in dense)
        assert sum(m.dense.amx_gated for m in dense) == len(runner.model.model.layers)
    assert runner.fused_decode.max_rows == _max_rows(runner) >= 1.5 * rows
    prompts = [[100 + 7 * b + i for i in range(1 + b % 2)] for b in range(rows)]
    pairs = _decode_both_ways(runner, steps=3, prompts=prompts)
    assert runner.fused_decode.steps == 4  # the prefill too: at most 1.5 * rows tokens
    for with_fused, per_op in pairs:
        assert with_fused.shape == (rows, per_op.shape[1])
        assert torch.equal(with_fused, per_op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_fused_extends_give_the_per_op_logits_exactly(tiny_llama_dir, dtype, quantization) -> None:
    """A mixed step (decoding rows beside a prompt's uncached tail) and chunks on cached
    prefixes: each new token a row of its own, reading its request's slots up to its position,
    as the kernels' extend attention reads them."""
    runner = _runner(tiny_llama_dir, dtype, quantization)
    fused = runner.fused_decode
    prompts = [[100 + 7 * b + i for i in range(4 + 3 * b)] for b in range(4)]
    runner.forward(_batch(ForwardMode.EXTEND, prompts, [0] * len(prompts)))
    lens = [len(p) for p in prompts]
    batches = [
        # three decoding requests and one whose prompt goes on by 3 tokens
        _batch(ForwardMode.EXTEND, [[11], [12], [13], [14, 15, 16]], lens),
        # chunks of 5 and 2 tokens on the first two requests' prefixes
        _batch(ForwardMode.EXTEND, [[21, 22, 23, 24, 25], [26, 27]], lens[:2]),
    ]
    steps = fused.steps
    for fb in batches:
        assert fused.supports(fb, runner.kv)
        with_fused, per_op = _both_ways(runner, fb)
        assert with_fused.shape == per_op.shape and torch.equal(with_fused, per_op)
    assert fused.steps == steps + len(batches)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("outsiders", [0, 2])
def test_a_shared_prefix_step_gives_the_per_op_logits_exactly(
    tiny_llama_dir, monkeypatch, mode, outsiders
):
    """Requests whose first slots are the same (a common prompt prefix, held once), decoding a
    token or extending by two, attend over those slots all together (the kernels'
    shared_prefix: bfloat16 with `sdpa_dense`, as CPUs with AMX have it; its results hold on
    any CPU), the same way in both paths, beside requests on prompts of their own
    (`outsiders`); close to attending over every slot request by request."""
    runner = _runner(tiny_llama_dir, torch.bfloat16, "int4")
    backend = runner.fused_decode.attention  # shared by every layer
    backend.sdpa_dense = True
    monkeypatch.setattr(CpuKernelAttention, "SHARED_MIN_SLOTS", 8)
    members, shared = CpuKernelAttention.SHARED_MIN_QUERIES, 12
    num = members + outsiders
    prefix = list(range(300, 300 + shared))
    own = [[400 + 3 * b + i for i in range(3)] for b in range(num)]
    # request 0 computes the prefix and its own tokens, the other members their own tokens
    # after it, the outsiders a prompt as long of their own
    prompts = (
        [prefix + own[0]]
        + own[1:members]
        + [[500 + b] * shared + own[b] for b in range(members, num)]
    )
    starts = [0] + [shared] * (members - 1) + [0] * outsiders
    runner.forward(_batch(ForwardMode.EXTEND, prompts, starts, shared, outsiders))
    lens = [shared + 3] * num
    tokens = [[7 + b] if mode == ForwardMode.DECODE else [7 + b, 30 + b] for b in range(num)]
    fb = _batch(mode, tokens, lens, shared, outsiders)
    sharing = fb.shared_prefix(8)
    assert sharing.slots == shared and sharing.queries == members * len(tokens[0])
    assert sharing.count == (None if not outsiders else members)
    assert backend.shared_prefix(fb, torch.bfloat16) is sharing
    assert backend.shared_prefix(fb, torch.float32).slots == 0
    steps = runner.fused_decode.steps
    with_fused, per_op = _both_ways(runner, fb)
    assert runner.fused_decode.steps == steps + 1
    assert torch.equal(with_fused, per_op)
    monkeypatch.setattr(CpuKernelAttention, "SHARED_MIN_SLOTS", 10**9)  # every slot, one by one
    plain = runner.forward(_batch(mode, tokens, lens, shared, outsiders))
    scale = plain.abs().max()
    assert (plain - per_op).abs().max() <= 0.02 * scale, (plain - per_op).abs().max() / scale
    assert plain.argmax(-1).tolist() == per_op.argmax(-1).tolist()


def test_fused_decode_is_not_taken_where_it_must_not_be(tiny_llama_dir) -> None:
    most = PackedLinear.PACKED_MAX_ROWS
    # a float copy past 8 rows, through oneDNN's reordered weight up to `most` rows
    runner = _runner(tiny_llama_dir, torch.float32, "int4", requests=most + 1)
    fused = runner.fused_decode
    stack = runner.model.model
    decode = _batch(ForwardMode.DECODE, [[7]] * (most + 1), [0] * (most + 1))
    assert fused.max_rows == most and not fused.supports(decode, runner.kv)
    runner.forward(decode)
    small = _batch(ForwardMode.DECODE, [[7], [8]], [0, 0])
    assert fused.supports(small, runner.kv)
    other_kv = KVCache(64, len(stack.layers), 2, 16, torch.float32, CPU)
    assert not fused.supports(small, other_kv)
    embeds = stack.embed_tokens(small.input_ids)
    # a fresh prompt past the kernels' few queries: SDPA's causal attention, not the kernels'
    fresh = _batch(ForwardMode.EXTEND, [list(range(7, 7 + 20))], [0])
    assert not fused.supports(fresh, runner.kv)
    with torch.inference_mode():
        stack(small, runner.kv, input_embeds=embeds)  # a vision model's way in
        runner.forward(fresh)
    assert fused.steps == 0
    runner.forward(small)
    assert fused.steps == 1


def test_no_fused_decode_without_blocks_biases_or_the_switch(
    tiny_llama_dir, tiny_qwen2_dir, monkeypatch
) -> None:
    assert _runner(tiny_llama_dir, torch.float32, "none").fused_decode is None
    qwen2 = _runner(tiny_qwen2_dir, torch.float32, "int4")  # q/k/v biases
    assert qwen2.fused_decode is None
    assert "no bias" in why_not_fused(qwen2.model.model, qwen2.kv)
    monkeypatch.setenv("SLUICE_FUSED_DECODE", "0")
    assert _runner(tiny_llama_dir, torch.float32, "int4").fused_decode is None


def test_fused_decode_checks_the_step_before_writing_anything(tiny_llama_dir) -> None:
    runner = _runner(tiny_llama_dir, torch.float32, "int8")
    fb = _batch(ForwardMode.DECODE, [[7]], [3])
    pools = [k.clone() for k in runner.kv.k]
    bad_slot = fb.out_cache_loc.clone().fill_(10**6)
    with pytest.raises(RuntimeError, match="outside the pool"):
        runner.fused_decode.layers.forward(
            fb.input_ids, fb.positions, bad_slot, fb.kv_indices, fb.seq_lens
        )
    with pytest.raises(RuntimeError, match="outside the vocab"):
        runner.fused_decode.layers.forward(
            fb.input_ids + 10**6, fb.positions, fb.out_cache_loc, fb.kv_indices, fb.seq_lens
        )
    # bit for bit: the slots never written hold whatever the allocator gave (NaN != NaN)
    pairs = zip(pools, runner.kv.k, strict=True)
    same = (torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
    assert all(same)


def test_engine_tokens_and_logprobs_fused_or_not_on_the_default_model(smollm2_gguf) -> None:
    from sluice import Engine

    engine = Engine(
        smollm2_gguf, dtype="bfloat16", quantization="gguf", embedding_model_path="none",
        max_total_tokens=8192, num_threads=2,
    )  # fmt: skip
    fused = engine.scheduler.runner.fused_decode
    assert fused is not None
    assert fused.max_rows == _max_rows(engine.scheduler.runner)
    interleaved = bool(quant_ops().interleaved_types)  # the layers and the LM head
    assert set(_interleaved(engine.scheduler.runner.model)) == {interleaved}
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = ["The river ran quietly beneath", "Write a haiku about the sea"]
    results = {}
    for on in (True, False):
        fused.enabled = on
        steps = fused.steps
        engine.scheduler.flush_cache()  # both runs prefill the whole prompts
        outs = engine.generate(prompts, params, return_logprob=True)
        results[on] = [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]
        taken = fused.steps - steps
        assert taken >= 11 if on else taken == 0  # 11 decode steps of the 2 requests, or more
    engine.shutdown()
    assert results[True] == results[False]
    assert len(results[True][0][0]) == 12
