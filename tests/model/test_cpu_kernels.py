"""sluice's C++ CPU kernels against the PyTorch ops they replace, and their wiring into the model
runner (the end-to-end logits parity in test_parity.py runs with and without them), and the build
cache that keys each build on its source, flags, torch, Python and CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sluice.checkpoint.model_config import ModelConfig
from sluice.model import kernels
from sluice.model.layers import PackedLinear, PagedAttention, RMSNorm, RotaryEmbedding, _rotate
from sluice.model.models.llama import LlamaMLP
from sluice.model.runner import ModelRunner

SLOTS = 4096
TOLERANCES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(scope="module")
def native_ops():
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    return ops


@pytest.fixture(scope="module", params=["native", "8-lanes"])
def ops(request, native_ops):
    """The build the runner uses (16-lane vectors where the CPU has AVX-512), and one forced to
    the 8 lanes of CPUs without it, so both widths are checked on any machine (at -O1: it is
    there for its code path, and builds in half the time)."""
    if request.param == "native":
        return native_ops
    return kernels._build("sluice_cpu_ops_8lanes", kernels.SOURCE, ("-DSLUICE_LANES=8", "-O1"))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The attention kernels split work by query when there are at least two per thread, else
    by (query, KV head): the tests' query counts take both ways under one thread and two."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _reference(q, k_pool, v_pool, indices, lens, scale) -> torch.Tensor:
    """Per request: SDPA of its one query over its first lens[b] slots, in float32."""
    rows = []
    for b in range(q.shape[0]):
        slots = indices[b, : lens[b]]
        k, v = k_pool[slots].float().transpose(0, 1), v_pool[slots].float().transpose(0, 1)
        qb = q[b].float().unsqueeze(1)  # [H, 1, D]
        out = F.scaled_dot_product_attention(
            qb, k, v, scale=scale, enable_gqa=q.shape[1] != k_pool.shape[1]
        )
        rows.append(out.squeeze(1))
    return torch.stack(rows)  # [B, H, D]


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128])
@pytest.mark.parametrize(
    "lens",
    [[1, 7, 130, 64, 255], [300], [1000], [700, 1]],
    # few queries on two threads split their slots into parts, the 1-slot one leaving one empty
    ids=["batch", "one", "one-long", "long-and-short"],
)
def test_decode_attention_matches_sdpa(
    ops, threads, dtype, atol, num_heads, num_kv_heads, head_dim, lens
) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + head_dim + len(lens))
    k_pool = torch.randn(SLOTS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, num_kv_heads, head_dim, generator=gen).to(dtype)
    indices = torch.zeros(len(lens), max(lens), dtype=torch.int64)  # 0-padded, like the runner's
    for b, n in enumerate(lens):  # scattered slots, as decode leaves them
        indices[b, :n] = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype) * 3
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    out = ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, head_dim**-0.5)
    want = _reference(q, k_pool, v_pool, indices, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


def _extend_case(seed: int, dtype: torch.dtype, prefix: list[int], extend: list[int]):
    """An extend of requests b with prefix[b] slots cached and extend[b] new tokens (9 heads,
    3 KV heads, head_dim 64, scattered slots): (q, k_pool, v_pool, indices, rows, q_lens)."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = 9, 3, 64
    k_pool = torch.randn(SLOTS, kv_heads, d, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, kv_heads, d, generator=gen).to(dtype)
    total = [p + e for p, e in zip(prefix, extend, strict=True)]
    indices = torch.zeros(len(total), max(total), dtype=torch.int64)
    for b, n in enumerate(total):
        indices[b, :n] = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1
    rows = torch.repeat_interleave(torch.arange(len(total)), torch.tensor(extend))
    q_lens = torch.cat([torch.arange(p, p + e) + 1 for p, e in zip(prefix, extend, strict=True)])
    q = torch.randn(len(rows), heads, d, generator=gen).to(dtype) * 3
    return q, k_pool, v_pool, indices, rows, q_lens


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize(
    ("prefix", "extend"), [([40, 0, 3], [5, 17, 1]), ([30], [1])], ids=["three", "one-token"]
)
def test_extend_attention_is_causal_over_each_requests_slots(
    ops, threads, dtype, atol, prefix, extend
) -> None:
    """Requests extend at once (e.g. 5 new tokens on a 40-token prefix, a fresh 17-token prompt,
    one token on 3); every query sees its request's slots up to its own position."""
    q, k_pool, v_pool, indices, rows, q_lens = _extend_case(7, dtype, prefix, extend)
    d = q.shape[2]
    out = ops.extend_attention(q, k_pool, v_pool, indices, rows, q_lens, d**-0.5)
    want = _reference(q, k_pool, v_pool, indices[rows], q_lens.tolist(), d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)
    last = indices.shape[1]  # the longest request's slots
    short = indices[:, : last - 1].contiguous()
    with pytest.raises(RuntimeError, match=f"sees {last} slots; it must see 1 to {last - 1}"):
        ops.extend_attention(q, k_pool, v_pool, short, rows, q_lens, d**-0.5)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
def test_extend_attention_gives_each_query_what_it_gets_alone(ops, threads, dtype, atol) -> None:
    """An extend's queries of one request are attended in groups of up to 8 that share each
    converted K and V row (100 new tokens on a 30-token prefix, a fresh 37-token prompt); each
    query's result is still the one it gets alone, as a decode query over the same slots, bit
    for bit, whatever group it falls in."""
    q, k_pool, v_pool, indices, rows, q_lens = _extend_case(13, dtype, [30, 0], [100, 37])
    d = q.shape[2]
    out = ops.extend_attention(q, k_pool, v_pool, indices, rows, q_lens, d**-0.5)
    want = _reference(q, k_pool, v_pool, indices[rows], q_lens.tolist(), d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)
    alone = [
        ops.decode_attention(q[t : t + 1], k_pool, v_pool, indices[rows[t]][None], q_lens[t : t + 1], d**-0.5)
        for t in range(len(rows))
    ]  # fmt: skip
    assert torch.equal(out, torch.cat(alone))


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lens", [[1, 7, 130, 64, 255], [1000]], ids=["batch", "one-long"])
@pytest.mark.parametrize("path", ["decode", "extend"])
def test_attention_holds_with_scores_hundreds_apart(ops, threads, dtype, atol, lens, path) -> None:
    """Scores spread over hundreds (q * 60): a softmax taken against anything but each head's
    largest score over all of a query's slots would overflow or vanish; it must match SDPA."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d = 9, 3, 64
    k_pool = torch.randn(SLOTS, kv_heads, d, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, kv_heads, d, generator=gen).to(dtype)
    indices = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        indices[b, :n] = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1
    q = (torch.randn(len(lens), heads, d, generator=gen) * 60).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    if path == "decode":
        out = ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, d**-0.5)
    else:  # each query its own request's row, seeing all its slots
        rows = torch.arange(len(lens))
        out = ops.extend_attention(q, k_pool, v_pool, indices, rows, seq_lens, d**-0.5)
    want = _reference(q, k_pool, v_pool, indices, lens, d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(
    ("num", "shared", "own"), [(8, 130, [1, 7, 30]), (3, 40, [2, 1, 300])], ids=["many", "few"]
)
def test_decode_attention_over_a_shared_prefix_matches_sdpa(
    ops, threads, dtype, atol, num_heads, num_kv_heads, head_dim, num, shared, own
) -> None:
    """Requests whose first `shared` slots are the same (scattered, as the radix cache leaves a
    prefix) and then slots of their own: attended over the shared ones all together
    (shared_prefix) the result is the plain kernel's, and SDPA's, up to rounding."""
    gen = torch.Generator().manual_seed(num * 100 + shared + num_heads + head_dim)
    k_pool = torch.randn(SLOTS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = [shared + own[b % len(own)] for b in range(num)]
    slots = torch.randperm(SLOTS - 1, generator=gen) + 1
    indices = torch.zeros(num, max(lens), dtype=torch.int64)
    indices[:, :shared] = slots[:shared]
    start = shared
    for b, n in enumerate(lens):
        indices[b, shared:n] = slots[start : start + n - shared]
        start += n - shared
    q = torch.randn(num, num_heads, head_dim, generator=gen).to(dtype) * 3
    seq_lens, scale = torch.tensor(lens, dtype=torch.int64), head_dim**-0.5
    out = ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, scale, shared)
    plain = ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, scale)
    want = _reference(q, k_pool, v_pool, indices, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)
    torch.testing.assert_close(out.float(), plain.float(), atol=atol, rtol=0)
    # a prefix that is not shared, or that leaves a request no slot of its own, is refused
    with pytest.raises(RuntimeError, match="request 1's first slots differ"):
        other = indices.clone()
        other[1, shared - 1] = slots[-1]
        ops.decode_attention(q, k_pool, v_pool, other, seq_lens, scale, shared)
    with pytest.raises(RuntimeError, match="sees only"):
        short = seq_lens.clone()
        short[-1] = shared
        ops.decode_attention(q, k_pool, v_pool, indices, short, scale, shared)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize(("num", "members"), [(8, [1, 3, 4, 6]), (3, [0, 2])])
def test_decode_attention_over_a_prefix_some_requests_share_matches_sdpa(
    ops, threads, dtype, atol, num, members
) -> None:
    """Some requests share their first 150 slots (`shared_requests`); the others read slots of
    their own from the first, and attend over all of them as without a prefix. Three requests
    on two threads split their work by KV head."""
    shared = 150
    gen = torch.Generator().manual_seed(11)
    k_pool = torch.randn(SLOTS, 3, 64, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, 3, 64, generator=gen).to(dtype)
    lens = [shared + 1 + 13 * b for b in range(num)]
    slots = torch.randperm(SLOTS - 1, generator=gen) + 1
    indices = torch.zeros(num, max(lens), dtype=torch.int64)
    start = shared
    for b, n in enumerate(lens):
        own = slots[start : start + n]
        indices[b, :n] = own
        start += n
        if b in members:
            indices[b, :shared] = slots[:shared]
    q = torch.randn(num, 9, 64, generator=gen).to(dtype) * 3
    seq_lens, scale = torch.tensor(lens, dtype=torch.int64), 0.125
    group = torch.tensor(members, dtype=torch.int64)
    out = ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, scale, shared, group)
    want = _reference(q, k_pool, v_pool, indices, lens, scale)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)
    outsider = next(b for b in range(num) if b not in members)
    pair = torch.tensor(sorted([members[0], outsider]))

    def call(shared_prefix: int, requests: torch.Tensor) -> None:
        ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, scale, shared_prefix, requests)

    with pytest.raises(RuntimeError, match="first slots differ"):
        call(shared, pair)
    with pytest.raises(RuntimeError, match="needs a shared_prefix"):
        call(0, group)
    for bad in ([2, 1], [1, num], []):
        with pytest.raises(RuntimeError, match="shared_requests"):
            call(shared, torch.tensor(bad, dtype=torch.int64))


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize("every", [True, False], ids=["every-request", "some-requests"])
def test_extend_attention_over_a_shared_prefix_matches_sdpa(ops, threads, dtype, atol, every):
    """An extend whose requests share their first 130 slots (cascade attention over a cached
    system prompt): requests with some cached slots of their own past it and new tokens, one
    decoding token among them, one member with no token in this call (the dense split takes
    such a request's away); without `every`, one request (3) reads slots of its own from its
    first. Each query's result is the plain kernel's and SDPA's, up to rounding."""
    shared = 130
    prefix = [shared + 4, shared, shared + 40, shared + 20 if every else 20, shared + 9]
    extend = [5, 30, 1, 7, 0]
    q, k_pool, v_pool, indices, rows, q_lens = _extend_case(17, dtype, prefix, extend)
    members = list(range(5)) if every else [0, 1, 2, 4]
    indices[members, :shared] = indices[0, :shared].clone()
    group = None if every else torch.tensor(members, dtype=torch.int64)
    d = q.shape[2]
    out = ops.extend_attention(q, k_pool, v_pool, indices, rows, q_lens, d**-0.5, shared, group)
    plain = ops.extend_attention(q, k_pool, v_pool, indices, rows, q_lens, d**-0.5)
    want = _reference(q, k_pool, v_pool, indices[rows], q_lens.tolist(), d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)
    torch.testing.assert_close(out.float(), plain.float(), atol=atol, rtol=0)
    # a member's query that sees no slot past the prefix is refused
    with pytest.raises(RuntimeError, match="a query of request 1 sees only 130 slots"):
        short = q_lens.clone()
        short[(rows == 1).nonzero()[0]] = shared
        ops.extend_attention(q, k_pool, v_pool, indices, rows, short, d**-0.5, shared, group)


@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads"), [(64, 9, 3), (128, 9, 3), (64, 4, 4), (64, 8, 1)]
)
def test_dense_attention_is_causal_over_each_long_requests_slots(
    native_ops, threads, head_dim, heads, kv_heads
):
    """The long requests of an extend on AMX tiles (`dense_attention_`), bfloat16: a fresh
    137-token prompt, a 50-token chunk on a 40-token prefix, and 33 tokens on 3 that are left
    out of the spans (their rows of out untouched); every query sees its request's slots up to
    its own position, as SDPA over them does. Spans outside q or kv_indices are refused."""
    ops = native_ops
    if not ops.amx_attention():
        pytest.skip("no AMX tiles here (amx_attention)")
    gen = torch.Generator().manual_seed(head_dim + heads)
    prefix, extend = [0, 40, 3], [137, 50, 33]
    k_pool = torch.randn(SLOTS, kv_heads, head_dim, generator=gen).bfloat16()
    v_pool = torch.randn(SLOTS, kv_heads, head_dim, generator=gen).bfloat16()
    total = [p + e for p, e in zip(prefix, extend, strict=True)]
    indices = torch.zeros(3, max(total), dtype=torch.int64)
    for b, n in enumerate(total):
        indices[b, :n] = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(extend))
    q_lens = torch.cat([torch.arange(p, p + e) + 1 for p, e in zip(prefix, extend, strict=True)])
    q = (torch.randn(len(rows), heads, head_dim, generator=gen) * 3).bfloat16()
    spans = torch.tensor([[0, 0, 137, 0], [1, 137, 50, 40]], dtype=torch.int64)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    ops.dense_attention_(out, q, k_pool, v_pool, indices, spans, scale)
    want = _reference(q, k_pool, v_pool, indices[rows], q_lens.tolist(), scale)
    torch.testing.assert_close(out[:187].float(), want[:187], atol=2e-2, rtol=0)
    assert bool((out[187:] == 7.0).all())
    # q as the qkv projection's view, its rows (heads + 2 kv_heads) * head_dim values apart
    qkv = torch.zeros(len(rows), heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16)
    qkv[:, :heads] = q
    strided = torch.full_like(q, 7.0)
    ops.dense_attention_(strided, qkv[:, :heads], k_pool, v_pool, indices, spans, scale)
    assert torch.equal(strided, out)
    for bad in ([3, 0, 1, 0], [0, 215, 10, 0], [1, 137, 50, 141], [0, 0, 0, 0]):
        with pytest.raises(RuntimeError, match="outside q or kv_indices"):
            ops.dense_attention_(out, q, k_pool, v_pool, indices, torch.tensor([bad]), scale)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.dense_attention_(out.float(), q.float(), k_pool, v_pool, indices, spans, scale)
    with pytest.raises(RuntimeError, match="contiguous"):  # a head's values not consecutive
        ops.dense_attention_(out, q.transpose(1, 2).contiguous().transpose(1, 2), k_pool,
                             v_pool, indices, spans, scale)  # fmt: skip
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        narrow = [t[..., :48].contiguous() for t in (out, q, k_pool, v_pool)]
        ops.dense_attention_(*narrow, indices, spans, scale)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
def test_decode_attention_over_a_long_shared_prefix_matches_sdpa(
    native_ops, threads, dtype, atol
) -> None:
    """Past one block of PyTorch's blocked attention in both directions (keys in blocks of 512,
    queries of 32: 1100 shared slots, 16 requests x 4 query heads a KV head), with 8 KV heads
    and head_dim 128."""
    num, shared, heads, kv_heads, dim = 16, 1100, 32, 8, 128
    gen = torch.Generator().manual_seed(7)
    k_pool = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, kv_heads, dim, generator=gen).to(dtype)
    lens = [shared + 1 + 9 * b for b in range(num)]
    slots = torch.randperm(SLOTS - 1, generator=gen) + 1
    indices = torch.zeros(num, max(lens), dtype=torch.int64)
    indices[:, :shared] = slots[:shared]
    for b, n in enumerate(lens):
        indices[b, shared:n] = slots[shared + 150 * b : shared + 150 * b + n - shared]
    q = torch.randn(num, heads, dim, generator=gen).to(dtype) * 3
    seq_lens, scale = torch.tensor(lens, dtype=torch.int64), dim**-0.5
    out = native_ops.decode_attention(q, k_pool, v_pool, indices, seq_lens, scale, shared)
    want = _reference(q, k_pool, v_pool, indices, lens, scale)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


def test_decode_attention_refuses_mismatched_inputs(ops) -> None:
    q = torch.zeros(2, 4, 64)
    pool = torch.zeros(16, 4, 64, dtype=torch.bfloat16)
    idx, lens = torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.decode_attention(q, pool, pool, idx, lens, 1.0)
    odd = torch.zeros(16, 4, 24)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        ops.decode_attention(torch.zeros(2, 4, 24), odd, odd, idx, lens, 1.0)
    pool = torch.zeros(16, 4, 64)
    with pytest.raises(RuntimeError, match="slot 16 is outside the pool of 16"):
        ops.decode_attention(q, pool, pool, torch.full((2, 3), 16), lens, 1.0)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ops.decode_attention(q, pool, torch.zeros(16, 2, 64), idx, lens, 1.0)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize("width", [576, 100])  # SmolLM2's, and one with a tail past 8 and 16 lanes
def test_rms_norm_and_fused_residual_add_match_pytorch(ops, dtype, atol, width) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, width, generator=gen) * 4).to(dtype)
    residual = torch.randn(37, width, generator=gen).to(dtype)
    weight = torch.rand(width, generator=gen).to(dtype) + 0.5
    want = F.rms_norm(x.float(), (width,), weight.float(), 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5).float(), want, atol=atol, rtol=atol)

    summed = x + residual  # rounded to the dtype, as the model's residual stream is
    want = F.rms_norm(summed.float(), (width,), weight.float(), 1e-5)
    out, res = x.clone(), residual.clone()
    ops.add_rms_norm_(out, res, weight, 1e-5)
    assert torch.equal(res, summed)
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize("width", [1536, 44])  # SmolLM2's, and one with a tail past 8 and 16 lanes
def test_silu_and_mul_matches_pytorch(ops, dtype, atol, width) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 2 * width, generator=gen) * 6).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    out = ops.silu_and_mul(x)
    assert out.shape == (9, width) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.silu(gate) * up, atol=atol, rtol=atol)


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
def test_rope_rotates_q_and_k_in_place_and_leaves_v(ops, dtype, atol) -> None:
    rope = RotaryEmbedding(64, 2048, 10000.0, None)
    heads, kv_heads, d = 9, 3, 64
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(11, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 5, 100, 2047, 7, 7, 3, 64, 65, 999])
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    qk = qkv[:, : (heads + kv_heads) * d].float().view(11, heads + kv_heads, d)
    want = _rotate(qk, cos, sin).view(11, -1)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    ops.rope_(qkv, positions, rope.cos, rope.sin, heads + kv_heads, d)
    torch.testing.assert_close(qkv[:, : (heads + kv_heads) * d].float(), want, atol=atol, rtol=atol)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)
    with pytest.raises(RuntimeError, match="position 2048 is outside"):
        ops.rope_(qkv, torch.full((11,), 2048), rope.cos, rope.sin, heads + kv_heads, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 300, 1000])  # 1000: past one 256-row chunk a thread
def test_store_kv_writes_the_rows_index_copy_writes(native_ops, threads, dtype, rows) -> None:
    """K and V as the qkv projection's views (row stride 960, not 192) land where index_copy_
    puts them, bit for bit, and nothing else in the pools moves."""
    heads, kv_heads, d, slots = 9, 3, 64, 2048
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    k, v = (t.view(rows, kv_heads, d) for t in qkv[:, heads * d :].chunk(2, dim=-1))
    loc = torch.randperm(slots, generator=gen)[:rows]
    pools = [torch.randn(slots, kv_heads, d, generator=gen).to(dtype) for _ in range(2)]
    want = [p.clone().index_copy_(0, loc, x) for p, x in zip(pools, (k, v), strict=True)]
    native_ops.store_kv_(pools[0], pools[1], loc, k, v)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])


def test_store_kv_refuses_what_it_cannot_copy_whole(native_ops) -> None:
    pools = [torch.zeros(16, 3, 64) for _ in range(2)]
    k = torch.randn(4, 3, 64)
    with pytest.raises(RuntimeError, match="slot 16 is outside the pool of 16"):
        native_ops.store_kv_(pools[0], pools[1], torch.tensor([1, 2, 3, 16]), k, k)
    for bad in (k.transpose(1, 2).contiguous().transpose(1, 2), torch.randn(4, 3, 128)[..., :64]):
        with pytest.raises(RuntimeError, match="each row's values consecutive"):
            native_ops.store_kv_(pools[0], pools[1], torch.arange(4), bad, k)
    with pytest.raises(RuntimeError, match="in their pool's dtype"):
        native_ops.store_kv_(pools[0], pools[1], torch.arange(4), k, k.bfloat16())
    with pytest.raises(RuntimeError, match="of one shape and dtype"):
        native_ops.store_kv_(pools[0], pools[1].bfloat16(), torch.arange(4), k, k.bfloat16())
    with pytest.raises(RuntimeError, match=r"loc: \[T\] contiguous int64"):
        native_ops.store_kv_(pools[0], pools[1], torch.arange(4, dtype=torch.int32), k, k)
    assert not pools[0].any() and not pools[1].any()


@pytest.mark.parametrize(("dtype", "atol"), TOLERANCES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (16, 1536)])  # a tail past 8, 16 lanes
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_small_linear_matches_f_linear(ops, threads, dtype, atol, rows, n, k, with_bias) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    got = ops.small_linear(x, w, bias)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


def test_small_linear_refuses_what_it_cannot_take(ops) -> None:
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    refusals = [
        (torch.randn(5, 64), w, None, "1 to 4 rows, not 5"),
        (torch.randn(2, 40), torch.randn(8, 40), None, "multiple of"),
        (x, torch.randn(8, 32), None, "x has 64 columns, w 32"),
        (x, w.bfloat16(), None, "x's dtype"),
        (x, w, torch.randn(7), "bias"),
        (x.t().contiguous().t(), w, None, "contiguous"),
    ]
    for xx, ww, bb, message in refusals:
        with pytest.raises(RuntimeError, match=message):
            ops.small_linear(xx, ww, bb)
    assert ops.small_linear_max_rows == 4 and ops.small_linear_k_multiple in (16, 32)


def _grammar_case(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [8, vocab] with ties and masks [8, ceil(vocab / 32)] of every kind: random bits,
    none, all, one (the sign bit of a word), only bits past the vocabulary, a tie between two
    allowed tokens and a larger disallowed one."""
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    logits = torch.randn(8, vocab, generator=g)
    logits[:, 3] = logits[:, vocab - 1] = 9.0  # ties, allowed or not
    masks = torch.randint(-(2**31), 2**31 - 1, (8, words), dtype=torch.int32, generator=g)
    masks[1] = 0
    masks[2] = -1
    masks[3] = 0
    masks[3, (vocab - 1) // 32] = -(2**31) if vocab % 32 == 0 else 1 << ((vocab - 1) % 32)
    masks[4] = 0
    if vocab % 32:
        masks[4, -1] = -(2**31)  # a bit past the vocabulary: nothing allowed
    masks[5] = 0
    masks[5, 0] = 1 << 1 | 1 << 2
    logits[5, 1] = logits[5, 2] = 5.0  # the allowed maximum, tied; token 3 (9.0) is not allowed
    return logits, masks


@pytest.mark.parametrize("vocab", [49152, 1000, 70, 64, 33])
def test_grammar_masks_match_the_bias_add(ops, vocab) -> None:
    """masked_argmax and grammar_mask_ read bit t of word w as token 32 w + t: the same tokens
    and logits as adding the sampler's float bias, on every row or on some rows."""
    from sluice.model.sampler import grammar_bias

    logits, masks = _grammar_case(vocab, vocab)
    masked = logits + grammar_bias(masks, vocab)
    assert torch.equal(ops.masked_argmax(logits, masks), masked.argmax(dim=-1))
    assert ops.masked_argmax(logits, masks)[[1, 4, 5]].tolist() == [0, 0, 1]
    out = logits.clone()
    ops.grammar_mask_(out, masks)
    assert torch.equal(out, masked)
    rows = torch.tensor([6, 0, 5])
    sub = masks[[0, 1, 5]].contiguous()
    want = logits[rows] + grammar_bias(sub, vocab)
    assert torch.equal(ops.masked_argmax(logits, sub, rows), want.argmax(dim=-1))
    out = logits.clone()
    ops.grammar_mask_(out, sub, rows)
    assert torch.equal(out[rows], want)
    others = [1, 2, 3, 4, 7]
    assert torch.equal(out[others], logits[others])


def test_grammar_masks_refuse_what_they_cannot_take(ops) -> None:
    logits, masks = torch.randn(2, 70), torch.zeros(2, 3, dtype=torch.int32)
    refusals = [
        (logits, masks[:, :2].contiguous(), None, "2 words cannot cover 70 tokens"),
        (logits.double(), masks, None, "float32"),
        (logits, masks.long(), None, "int32"),
        (logits.t().contiguous().t(), masks, None, "contiguous rows"),
        (logits, masks, torch.tensor([0, 2]), "row 2 is outside the 2 rows"),
        (logits, masks, torch.tensor([0]), r"int64 \[2\]"),
        (torch.randn(3, 70), masks, None, "2 masks for 3 rows"),
    ]
    for x, m, rows, message in refusals:
        with pytest.raises(RuntimeError, match=message):
            ops.masked_argmax(x, m, rows)
        with pytest.raises(RuntimeError, match=message):
            ops.grammar_mask_(x.clone(), m, rows)


def test_packed_linear_takes_the_kernel_for_a_few_rows_only(native_ops) -> None:
    calls: list[int] = []

    class Counting:  # native_ops, counting small_linear's calls by rows
        def __getattr__(self, name):
            return getattr(native_ops, name)

        def small_linear(self, x, w, bias):
            calls.append(x.shape[0])
            return native_ops.small_linear(x, w, bias)

    w, bias = torch.randn(40, 64), torch.randn(40)
    layer = PackedLinear(w, bias)
    layer.cpu_ops = Counting()
    for rows in (0, 1, 4, 5, 64, 100):  # 0: a prefill chunk that wants no logits
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
    assert calls == [1, 4]
    odd = PackedLinear(torch.randn(8, 40), None)  # 40 columns: not a multiple of 16 or 32
    odd.cpu_ops = Counting()
    odd(torch.randn(1, 40))
    assert calls == [1, 4]


def _needs_amx(ops) -> None:
    if not ops.amx_linear_ok():
        pytest.skip("no AMX tiles here (amx_linear_ok)")


# 1100: tasks of several row blocks, the last of them a tail
@pytest.mark.parametrize("rows", [1, 31, 33, 64, 100, 300, 1100])
# a tail of outputs; 3 passes over K; three uneven ones (41 steps of 32: 14, 14 and 13) and 40
# outputs; 3 passes over a single block of outputs (one buffer of sums: a row block's rounding
# ends before the next row block's sums are stored in it)
@pytest.mark.parametrize(("n", "k"), [(960, 576), (50, 96), (576, 1536), (40, 1312), (20, 1312)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_amx_linear_matches_f_linear(native_ops, rows, n, k, with_bias) -> None:
    """The AMX GEMM on bfloat16 (`amx_linear` on `amx_pack_linear`'s layout): float32 sums
    rounded once, so within a rounding step of the float32 result, for x in place or a
    strided view; and the same bits on one thread as on two (each output is summed within one
    task)."""
    ops = native_ops
    _needs_amx(ops)
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k + 32, generator=gen).bfloat16()[:, 32:]  # rows k + 32 apart
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    packed = ops.amx_pack_linear(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = ops.amx_linear(x, packed, n, bias)
        torch.set_num_threads(1)
        assert torch.equal(ops.amx_linear(x.contiguous(), packed, n, bias), got)
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=8e-3)


@pytest.mark.parametrize("rows", [7, 100, 1100])  # 1100: tasks of several row blocks
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
# one slice of outputs and one pass over K; 3 passes; SmolLM2's gate_up: 6 slices, one pass
@pytest.mark.parametrize(("inter", "k"), [(96, 64), (64, 1312), (1536, 576)])
def test_amx_linear_silu_mul_is_silu_and_mul_of_the_product(
    native_ops, rows, with_bias, inter, k
) -> None:
    """With the rows of gate and up paired by 16, `silu_mul` gives what silu_and_mul gives on
    the plain product, bit for bit, on two threads and on one."""
    ops = native_ops
    _needs_amx(ops)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(2 * inter, k, generator=gen) / 4).bfloat16()
    bias = torch.randn(2 * inter, generator=gen).bfloat16() if with_bias else None
    want = ops.silu_and_mul(ops.amx_linear(x, ops.amx_pack_linear(w), 2 * inter, bias))

    def paired(t):
        return t.reshape(2, inter // 16, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    packed = ops.amx_pack_linear(paired(w))
    bias_paired = None if bias is None else paired(bias)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            assert torch.equal(ops.amx_linear(x, packed, 2 * inter, bias_paired, True), want)
    finally:
        torch.set_num_threads(before)


def test_amx_linear_refuses_what_it_cannot_take(native_ops) -> None:
    ops = native_ops
    _needs_amx(ops)
    w = torch.randn(64, 64).bfloat16()
    packed = ops.amx_pack_linear(w)
    x = torch.randn(40, 64).bfloat16()
    for width in (40, 0):
        with pytest.raises(RuntimeError, match=f"in_features {width} is not a positive multiple"):
            ops.amx_pack_linear(torch.randn(8, width).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_pack_linear(w.float())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(x.float(), packed, 64)
    with pytest.raises(RuntimeError, match="does not hold 96 outputs of 64 values"):
        ops.amx_linear(x, packed, 96)
    with pytest.raises(RuntimeError, match="bias of 64 values"):
        ops.amx_linear(x, packed, 64, torch.zeros(63))
    with pytest.raises(RuntimeError, match="pairs of 16"):
        ops.amx_linear(x, ops.amx_pack_linear(w[:48]), 48, None, True)


def test_packed_linear_takes_the_amx_gemm_from_its_amx_rows(native_ops, monkeypatch) -> None:
    """A bfloat16 PackedLinear: batches of AMX_MIN_ROWS rows or more on the AMX GEMM, fewer on
    oneDNN's copy (or small_linear); as a gate_up projection (`fuse_silu_mul`, which moves the
    copy's tiles), `silu_mul` gives silu_and_mul of the layer's output bit for bit from those
    batches, None for smaller ones, and the plain output stays the same, with the plain weight
    dropped too (`drop_plain`). SLUICE_AMX_LINEAR=0 leaves the layer without the AMX copy."""
    _needs_amx(native_ops)
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(2 * 48, 64, generator=gen) / 8).bfloat16()
    bias = torch.randn(2 * 48, generator=gen).bfloat16()
    layer = PackedLinear(w, bias)
    layer.cpu_ops = native_ops
    assert layer.amx is not None
    x = torch.randn(PackedLinear.PACKED_MAX_ROWS + 9, 64, generator=gen).bfloat16()
    plain = layer(x)
    assert torch.equal(plain, native_ops.amx_linear(x, layer.amx, 96, bias))
    at_least = x[: PackedLinear.AMX_MIN_ROWS]  # a decode batch that takes it
    assert torch.equal(layer(at_least), native_ops.amx_linear(at_least, layer.amx, 96, bias))
    assert layer.silu_mul(x) is None  # not a gate_up layer yet
    assert layer.fuse_silu_mul() and not layer.fuse_silu_mul()  # once
    gate, up = w.split(48)  # the copy laid out again from the rows paired by 16
    paired = torch.stack([gate.reshape(3, 16, 64), up.reshape(3, 16, 64)], 1).reshape(96, 64)
    assert torch.equal(layer.amx, native_ops.amx_pack_linear(paired))
    assert torch.equal(layer.silu_mul(x), native_ops.silu_and_mul(plain))
    assert torch.equal(layer(x), plain)
    assert torch.equal(layer(at_least), plain[: PackedLinear.AMX_MIN_ROWS])
    assert torch.equal(layer.silu_mul(at_least), native_ops.silu_and_mul(plain)[: len(at_least)])
    few = x[: PackedLinear.AMX_MIN_ROWS - 1]
    assert layer.silu_mul(few) is None
    assert torch.equal(layer(few), layer._packed(few))
    small, tiny = layer(few), x[:2]  # tiny: small_linear's rows, on the plain weight
    assert layer.drop_plain() and layer.weight is None
    assert torch.equal(layer(x), plain) and torch.equal(layer(few), small)
    assert torch.equal(layer(tiny), layer._packed(tiny))  # now oneDNN's copy
    assert layer.drop_onednn() and layer.packed is None  # then the AMX copy takes every batch
    paired_out = native_ops.amx_linear(few, layer.amx, 96, layer.amx_bias)
    order = torch.arange(96).reshape(3, 2, 16).transpose(0, 1).reshape(96)  # back from pairs
    assert torch.equal(layer(few), paired_out[:, order])
    odd = PackedLinear(torch.randn(40, 64).bfloat16(), None)  # 20 gate rows: not pairs of 16
    assert odd.amx is not None and not odd.fuse_silu_mul()
    float32 = PackedLinear(torch.randn(40, 64), None)  # no AMX copy: nothing to drop
    assert not float32.drop_plain() and not float32.drop_onednn()
    monkeypatch.setenv("SLUICE_AMX_LINEAR", "0")
    assert PackedLinear(w, bias).amx is None


def test_a_bfloat16_mlp_takes_its_silu_from_the_gate_up_gemm(tiny_llama_dir, native_ops) -> None:
    """A bfloat16 model on a CPU with AMX: every gate_up projection is fused at load, and an
    MLP's output over many rows is the unfused one's, bit for bit."""
    _needs_amx(native_ops)
    runner = ModelRunner(
        ModelConfig.from_hf_dir(tiny_llama_dir), torch.device("cpu"), torch.bfloat16, kv_size=64
    )
    mlps = [m for m in runner.model.modules() if isinstance(m, LlamaMLP)]
    assert mlps and all(m.gate_up_proj.amx_gated for m in mlps)
    mlp = mlps[0]
    x = torch.randn(PackedLinear.PACKED_MAX_ROWS * 2, mlp.gate_up_proj.weight.shape[1]).bfloat16()
    with torch.inference_mode():
        fused = mlp(x)
        gate_up = mlp.gate_up_proj  # back to the plain layout: its GEMM, then silu_and_mul
        assert gate_up.bias is None  # so amx_bias needs no unpairing
        gate_up.amx, gate_up.amx_gated = native_ops.amx_pack_linear(gate_up.weight), False
        assert torch.equal(mlp(x), fused)


def _modules_with_ops(runner: ModelRunner) -> dict[type, list]:
    found: dict[type, list] = {}
    for module in runner.model.modules():
        if hasattr(type(module), "cpu_ops"):
            found.setdefault(type(module), []).append(module.cpu_ops)
    return found


def test_runner_hands_the_kernels_to_every_layer(tiny_llama_dir: str, native_ops) -> None:
    runner = ModelRunner(
        ModelConfig.from_hf_dir(tiny_llama_dir), torch.device("cpu"), torch.float32, kv_size=64
    )
    found = _modules_with_ops(runner)
    assert set(found) == {PagedAttention, RMSNorm, RotaryEmbedding, LlamaMLP, PackedLinear}
    assert all(o is native_ops for held in found.values() for o in held)
    assert runner.cpu_ops is native_ops  # the sampler's, for grammar masks
    assert runner.kv.cpu_ops is native_ops  # the per-op path's K/V writes (store_kv_)


def test_float16_on_cpu_keeps_the_pytorch_path(tiny_llama_dir: str) -> None:
    runner = ModelRunner(
        ModelConfig.from_hf_dir(tiny_llama_dir), torch.device("cpu"), torch.float16, kv_size=64
    )
    found = _modules_with_ops(runner)
    assert found and all(o is None for held in found.values() for o in held)
    assert runner.kv.cpu_ops is kernels.cpu_ops()  # a copy of rows, in any dtype (store_kv_)


# ---- the build cache ------------------------------------------------------------------------

TINY_SOURCE = """#include <pybind11/pybind11.h>
int answer() { return ANSWER; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
# a fresh process: builds (or reuses) a kernel and prints its answer; `no-builder` makes any call
# of torch's builder fail, so a reuse is proven to load the folder as it is
BUILD_SCRIPT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(message)s")
if sys.argv[3] == "no-builder":
    import torch.utils.cpp_extension

    def refuse(*args, **kwargs):
        raise AssertionError("torch's builder was called")

    torch.utils.cpp_extension.load = refuse
from sluice.model import kernels
if sys.argv[1] == "real":
    print("ANSWER", kernels.cpu_ops().attention_head_dims)
else:
    flags = ("-DANSWER=42", "-O0")
    print("ANSWER", kernels._build(sys.argv[1], Path(sys.argv[2]), flags).answer())
    code = Path(sys.argv[2]).read_bytes()  # the key again, after a build in this process
    print("FOLDER", kernels.build_folder(sys.argv[1], code, [*kernels.CFLAGS, *flags]))
"""


def _build_in_fresh_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BUILD_SCRIPT, *args], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


def _output(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def test_build_key_covers_source_flags_torch_python_and_cpu() -> None:
    base = (b"int f();", ["-O3", "-DSLUICE_LANES=8"], "2.13.0+cpu", "cpython-311", "avx512f")
    key = kernels.build_key(*base)
    assert kernels.build_key(*base) == key and len(key) == 16
    changed = [
        (b"int g();", *base[1:]),
        (base[0], ["-O3"], *base[2:]),
        (*base[:2], "2.14.0+cpu", *base[3:]),
        (*base[:3], "cpython-312", base[4]),
        (*base[:4], "avx2"),
    ]
    assert len({kernels.build_key(*parts) for parts in changed} | {key}) == len(changed) + 1


def test_build_folder_depends_on_the_bytes_and_flags_not_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    code = kernels.SOURCE.read_bytes()
    flags = [*kernels.CFLAGS, "-DSLUICE_LANES=8"]
    folder = kernels.build_folder("k", code, flags)
    assert folder.parent == tmp_path / "kernels" and folder.name.startswith("k-")
    assert kernels.build_folder("k", bytes(code), list(flags)) == folder  # a second checkout
    assert kernels.build_folder("k", code + b"\n// edited", flags) != folder
    assert kernels.build_folder("k", code, kernels.CFLAGS) != folder


def test_a_kernel_builds_once_and_fresh_processes_load_it_without_the_builder(
    tmp_path: Path,
) -> None:
    env = {"SLUICE_CACHE_DIR": str(tmp_path / "cache")}
    first, second = tmp_path / "one" / "tiny.cpp", tmp_path / "two" / "tiny.cpp"
    for source in (first, second):  # two checkouts of the same source
        source.parent.mkdir()
        source.write_text(TINY_SOURCE)
    # two processes at once on an empty cache: one builds, the other waits for it and loads
    procs = [_build_in_fresh_process("sluice_tiny", str(first), "builder", env=env)
             for _ in range(2)]  # fmt: skip
    outs = [_output(proc) for proc in procs]
    assert all("ANSWER 42" in out for out in outs), outs
    assert sum(out.count("building sluice's CPU kernels sluice_tiny") for out in outs) == 1, outs
    assert sum(out.count("built the CPU kernels sluice_tiny in") for out in outs) == 1, outs
    (folder,) = [p for p in (tmp_path / "cache" / "kernels").iterdir() if p.is_dir()]
    assert (folder / kernels.BUILD_INFO).is_file()  # and no temporary folder left behind
    assert all(f"FOLDER {folder}\n" in out for out in outs), outs  # a build changes no key
    out = _output(_build_in_fresh_process("sluice_tiny", str(second), "no-builder", env=env))
    assert "ANSWER 42" in out and "reusing the CPU kernels sluice_tiny" in out, out
    assert "building" not in out
    # a finished build whose .so no longer loads is built again in its place, once
    (so,) = folder.glob("*.so")
    so.write_bytes(b"truncated")
    out = _output(_build_in_fresh_process("sluice_tiny", str(second), "builder", env=env))
    assert "ANSWER 42" in out and "do not load" in out and "built the CPU kernels" in out, out
    out = _output(_build_in_fresh_process("sluice_tiny", str(second), "no-builder", env=env))
    assert "ANSWER 42" in out and "building" not in out, out


def test_a_fresh_process_loads_the_built_kernels_without_the_builder(native_ops) -> None:
    out = _output(_build_in_fresh_process("real", "", "no-builder"))
    assert f"ANSWER {native_ops.attention_head_dims}" in out and "building" not in out, out


def test_argmax_rows_refuses_what_it_cannot_take(ops) -> None:
    refusals = [
        (torch.randn(2, 70).double(), "float32"),
        (torch.randn(70, 2).t(), "contiguous rows"),
        (torch.randn(70), "2-D"),
        (torch.randn(2, 0), "rows of 0 logits"),
    ]
    for x, message in refusals:
        with pytest.raises(RuntimeError, match=message):
            ops.argmax_rows(x)


def test_argmax_and_finite_rows_take_bfloat16_as_its_float32_widening(ops) -> None:
    """bfloat16 logits (a step that only wants argmaxes skips the float32 copy): the same rows
    flagged and the same indices as the float32 logits they widen to exactly, in the vector part
    and the tail past the last whole vector (V = 70), ties on the first index."""
    x = torch.randn(10, 70).bfloat16()
    x[1, 3], x[2, 69], x[3, 40] = float("nan"), float("inf"), float("-inf")
    x[4, [7, 66]] = 9.0  # a tie between the vector part and the tail
    x[5, 65] = 9.0  # the maximum alone in the tail
    x[6] = 0.0  # every value tied: index 0
    x[7, 68] = 3e38  # finite in bfloat16 too
    wide = x.float()
    expected = torch.isfinite(wide).all(dim=-1).tolist()
    assert expected == [True, False, False, False, True, True, True, True, True, True]
    assert ops.finite_rows(x) == expected
    assert ops.finite_rows(x[::3]) == expected[::3]  # rows with a stride of their own
    no_nan = [r for r in range(10) if r != 1]  # argmax_rows is torch.argmax's for no NaN
    got = ops.argmax_rows(x[no_nan])
    assert got.tolist() == wide[no_nan].argmax(dim=-1).tolist()
    assert got.tolist()[3:6] == [7, 65, 0]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_rows(x.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 70, 90, 4099])  # 90: an odd number of whole vectors
def test_greedy_rows_is_argmax_rows_where_finite_rows_holds_else_minus_one(ops, dtype, vocab):
    """`greedy_rows` (one pass) against `argmax_rows` and `finite_rows` (two): each row's first
    index of its maximum where every value is finite, -1 where one is not, wherever the
    maximum, the ties and the non-finite values fall (the vector part, the tail past the last
    whole vector, a row shorter than one vector), on rows with a stride of their own."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(24, vocab, generator=g).to(dtype)
    last = vocab - 1
    x[1, 3 % vocab] = float("nan")
    x[2, last] = float("inf")
    x[3, vocab // 2] = float("-inf")
    x[4, [0, last]] = 9.0  # a tie between the first and the last index
    x[5, last] = 9.0  # the maximum alone at the end
    x[6] = 0.0  # every value tied: index 0
    x[7, vocab // 3] = 3e38  # finite in bfloat16 too
    x[8, [vocab // 2, vocab // 2 + 1 if vocab > 2 else 0]] = 5.0  # neighbours tied
    x[9].fill_(float("-inf"))
    x[10, [last, last - 1]] = float("nan")
    if vocab > 40:  # ties across the kernel's two chains of alternate vectors, at 8 or 16 lanes
        x[11, [19, 35]] = 9.0
        x[12, [11, 19]] = 9.0
    if vocab == 90:  # the last whole vector, on the first chain alone, tied with the second's
        x[13, [17, 75]] = 9.0
        x[14, [75, 87]] = 9.0  # ... and with the tail past it
    for rows in (x, x[::3]):
        finite = ops.finite_rows(rows)
        argmax = ops.argmax_rows(rows).tolist()
        want = [t if ok else -1 for t, ok in zip(argmax, finite, strict=True)]
        got = ops.greedy_rows(rows)
        assert got.dtype == torch.int64 and got.tolist() == want
        wide = rows.float()
        for r, t in enumerate(want):
            if t >= 0:
                assert t == int(wide[r].argmax())
    assert ops.greedy_rows(x)[:11].tolist()[1:4] == [-1, -1, -1]
    assert ops.greedy_rows(x)[4:7].tolist() == [0, last, 0]
    if vocab > 40:
        assert ops.greedy_rows(x)[11:13].tolist() == [19, 11]
    if vocab == 90:
        assert ops.greedy_rows(x)[13:15].tolist() == [17, 75]
    assert ops.greedy_rows(torch.zeros(0, vocab, dtype=dtype)).tolist() == []
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.greedy_rows(x.half())
    with pytest.raises(RuntimeError, match="rows of 0 logits"):
        ops.greedy_rows(torch.zeros(2, 0))


def test_finite_rows_flags_each_row_with_a_nan_or_an_infinity(ops) -> None:
    """Every position of a row, in the vector part and the tail past the last whole vector
    (V = 70 is not a multiple of 8 or 16 lanes), and huge finite values that a row sum would
    take to inf."""
    x = torch.randn(10, 70)
    x[1, 3], x[2, 69], x[3, 40] = float("nan"), float("inf"), float("-inf")
    x[4, 0] = x[4, 1] = 3e38  # finite, though they add up to inf
    x[5, 65] = float("nan")
    x[6].fill_(float("-inf"))
    expected = torch.isfinite(x).all(dim=-1).tolist()
    assert expected == [True, False, False, False, True, False, False, True, True, True]
    assert ops.finite_rows(x) == expected
    assert ops.finite_rows(x[::2]) == expected[::2]  # rows with a stride of their own
    assert ops.finite_rows(torch.zeros(0, 70)) == []
    with pytest.raises(RuntimeError, match="float32"):
        ops.finite_rows(x.double())
