"""The llama stack's last layer past attention (o_proj, the MLP) and the final norm run on the
rows whose logits are wanted alone: a prompt's other rows need only their K/V, which every
layer still writes. Checked against the same forward run to the end on every row."""

from __future__ import annotations

import pytest
import torch

from sluice.model.forward_batch import ForwardMode
from tests.model.test_fused_decode import _batch, _runner, kernels  # noqa: F401 (autouse)


def _mlp_rows(runner) -> list[int]:
    """Rows each decoder layer's MLP saw in the forwards since, one list entry a call."""
    seen: list[int] = []
    for layer in runner.model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    return seen


def _full_rows_logits(runner, fb) -> torch.Tensor:
    """The logits of `fb.logits_index` from hidden states computed on every row."""
    model = runner.model
    with torch.inference_mode():
        hidden = model.model(fb, runner.kv)[fb.logits_index]
        return model.lm_head(hidden).float()


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_prefills_last_layer_runs_on_the_logits_rows_alone(tiny_llama_dir, quantization):
    runner = _runner(tiny_llama_dir, torch.float32, quantization)
    prompts = [list(range(100 * b, 100 * b + 30)) for b in range(1, 4)]  # 90 rows, 3 wanted
    fb = _batch(ForwardMode.EXTEND, prompts, [0, 0, 0])
    if runner.fused_decode is not None:  # past its 64 rows in float32: per op
        assert not runner.fused_decode.supports(fb, runner.kv)
    seen = _mlp_rows(runner)
    logits = runner.forward(fb)
    layers = len(runner.model.model.layers)
    assert seen == [90] * (layers - 1) + [3]
    full = _full_rows_logits(runner, fb)  # over the same slots, with the same K/V
    assert logits.shape == full.shape == (3, full.shape[1])
    assert torch.allclose(logits, full, atol=1e-4, rtol=1e-4), (logits - full).abs().max()


def test_every_row_runs_to_the_end_where_every_rows_logits_are_wanted(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, torch.float32, "none")
    tokens = [list(range(100, 110))]
    fb = _batch(ForwardMode.EXTEND, tokens, [0])
    fb.logits_index = torch.arange(10)  # prompt logprobs: every row's logits
    fb.all_logits = True
    seen = _mlp_rows(runner)
    assert runner.forward(fb).shape[0] == 10
    assert seen == [10] * len(runner.model.model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_path_runs_the_same_rows_to_the_end(tiny_llama_dir, dtype):
    """DecodeLayers runs the last layer past attention on the logits rows alone too, so its
    logits still equal the per-op path's bit for bit; a row outside the step is refused."""
    runner = _runner(tiny_llama_dir, dtype, "int4")
    fused = runner.fused_decode
    if fused is None:
        pytest.skip("no fused decode here (see the load log)")
    fb = _batch(ForwardMode.EXTEND, [[101, 102, 103, 104], [201, 202]], [0, 0])
    assert fused.supports(fb, runner.kv) and fb.logits_index.tolist() == [3, 5]
    steps = fused.steps
    with_fused = runner.forward(fb)
    assert fused.steps == steps + 1
    fused.enabled = False
    seen = _mlp_rows(runner)
    per_op = runner.forward(fb)
    assert seen == [6] * (len(runner.model.model.layers) - 1) + [2]
    assert with_fused.shape == per_op.shape == (2, per_op.shape[1])
    assert torch.equal(with_fused, per_op)
    fused.enabled = True
    with pytest.raises(RuntimeError, match="outside the step"):
        fused.forward(fb, torch.tensor([3, 6]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_chunk_whose_logits_nobody_wants_writes_its_kv_alone(tiny_llama_dir, dtype, quantization):
    """A prompt's chunk before its last has no logits rows: both paths give no rows and write
    every token's K/V, which the next chunk then reads as the unchunked prompt would have."""
    tokens = list(range(100, 110))
    want = None
    for fused_on, chunked in ((True, False), (True, True), (False, True)):
        runner = _runner(tiny_llama_dir, dtype, quantization)
        fused = runner.fused_decode
        if fused is not None:
            fused.enabled = fused_on
        if chunked:
            first = _batch(ForwardMode.EXTEND, [tokens[:6]], [0])
            first.logits_index = torch.zeros(0, dtype=torch.int64)
            steps = 0 if fused is None else fused.steps
            seen = _mlp_rows(runner)
            assert runner.forward(first).shape[0] == 0
            if quantization == "int4" and fused_on:  # DecodeLayers took the chunk
                assert fused is not None and fused.steps == steps + 1
            else:  # the per-op path: its last layer's MLP saw no rows
                assert seen == [6] * (len(runner.model.model.layers) - 1) + [0]
            logits = runner.forward(_batch(ForwardMode.EXTEND, [tokens[6:]], [6]))
        else:
            logits = runner.forward(_batch(ForwardMode.EXTEND, [tokens], [0]))
        if want is None:
            want = logits
        else:
            tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max()
            assert (logits - want).abs().max() <= tol
