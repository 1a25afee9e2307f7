"""The attention backends behind PagedAttention: which one takes which batch, that those which can
compute a batch agree on it, and that a backend plugs in from outside the model files.

The backends run here directly on a KV pool and `ForwardBatch`es the tests build; the end-to-end
logits against transformers are test_parity.py's, the kernels themselves test_cpu_kernels.py's.
"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend

from sluice.checkpoint.model_config import ModelConfig
from sluice.model import attention as attention_module
from sluice.model import kernels
from sluice.model.attention import (
    CpuKernelAttention,
    SdpaAttention,
    pick_backend,
    select_backends,
)
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.kv_cache import KVCache
from sluice.model.layers import PagedAttention
from sluice.model.runner import ModelRunner

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
FAKE_OPS = SimpleNamespace(attention_head_dims=(HEAD_DIM,))  # what select_backends reads

# (mode, prefix_lens, extend_lens) -> the backend that takes it: SDPA for one fresh prompt and
# for dense prefills of many queries a request, the kernels for decode, sparse prefills, and
# extends of few queries a request however dense (CpuKernelAttention.MAX_FEW_QUERIES)
CASES = {
    "decode-uneven": (ForwardMode.DECODE, [6, 40, 1], [1, 1, 1], "cpu-kernels"),
    "decode-even": (ForwardMode.DECODE, [9, 9], [1, 1], "cpu-kernels"),
    "one-fresh-prompt": (ForwardMode.EXTEND, [0], [37], "sdpa"),
    "prompts-of-different-lengths": (ForwardMode.EXTEND, [0, 0, 0], [3, 40, 9], "cpu-kernels"),
    "chunk-on-a-long-prefix": (ForwardMode.EXTEND, [100], [50], "sdpa"),  # density 0.84
    "one-token-on-a-prefix": (ForwardMode.EXTEND, [30], [1], "cpu-kernels"),  # density 1
    # a cached prompt's last token beside decoding requests (a mixed step): density 0.92
    "decodes-beside-a-last-token": (ForwardMode.EXTEND, [30, 28, 25], [1, 1, 1], "cpu-kernels"),
    "short-chunk-on-a-long-prefix": (ForwardMode.EXTEND, [100], [16], "cpu-kernels"),  # 0.93
    "fresh-short-prompt": (ForwardMode.EXTEND, [0], [5], "cpu-kernels"),
    "short-chunks-on-prefixes": (ForwardMode.EXTEND, [20, 0], [4, 24], "cpu-kernels"),
    # a chunk on a prefix before a short fresh prompt: density 0.34
    "chunk-then-short-prompt": (ForwardMode.EXTEND, [10, 0], [20, 2], "cpu-kernels"),
}


def _batch(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], stale: int = 0
) -> ForwardBatch:
    """Request b owns slots after request b-1's, so slot 0 stays the padding slot; `stale` is
    what a request's row of req_to_token holds past its length (a slot of an earlier owner)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    req_to_token = torch.full((len(seq_lens), max(seq_lens)), stale, dtype=torch.int64)
    new_slots, start = [], 1
    for b, (p, n) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
        req_to_token[b, :n] = torch.arange(start, start + n)
        new_slots.append(req_to_token[b, p:n])
        start += n
    num_tokens = sum(extend_lens)
    return ForwardBatch.build(
        mode, [0] * num_tokens, prefix_lens, extend_lens, torch.cat(new_slots), req_to_token,
        list(range(len(seq_lens))), [num_tokens - 1], CPU,
    )  # fmt: skip


class Recording:
    """A backend from outside the model files: takes decode only, answers zeros, and notes what
    the pool held for this step's first token when it ran."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def supports(self, fb: ForwardBatch) -> bool:
        return fb.mode == ForwardMode.DECODE

    def forward(self, q, k, v, fb, kv, layer) -> torch.Tensor:
        self.seen.append(kv.k[layer.layer_id][fb.out_cache_loc[0]].clone())
        return q.new_zeros(q.shape[0], layer.num_heads * layer.head_dim)


@pytest.mark.parametrize("case", CASES)
def test_each_batch_goes_to_the_backend_that_took_it_before(case) -> None:
    mode, prefix_lens, extend_lens, want = CASES[case]
    fb = _batch(mode, prefix_lens, extend_lens)
    assert pick_backend(select_backends(CPU, HEAD_DIM, FAKE_OPS), fb).name == want
    assert pick_backend(select_backends(CPU, HEAD_DIM, None), fb).name == "sdpa"


def test_select_backends_prefers_the_kernels_where_they_take_the_head_dim(monkeypatch) -> None:
    def names(device: str, head_dim: int, ops) -> list[str]:
        return [b.name for b in select_backends(torch.device(device), head_dim, ops)]

    assert names("cpu", HEAD_DIM, FAKE_OPS) == ["cpu-kernels", "sdpa"]
    assert names("cpu", 24, FAKE_OPS) == ["sdpa"]  # no kernel compiled for this head_dim
    assert names("cpu", HEAD_DIM, None) == ["sdpa"]  # not built, or a dtype they do not take
    monkeypatch.setenv("SLUICE_CUDA_SDPA", "cudnn,math")  # read at selection, not at first use
    (sdpa,) = select_backends(torch.device("cuda"), HEAD_DIM, None)
    assert isinstance(sdpa, SdpaAttention)
    assert sdpa.cuda_backends == [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    monkeypatch.setenv("SLUICE_CUDA_SDPA", "fast")
    with pytest.raises(ValueError, match="SLUICE_CUDA_SDPA"):
        select_backends(torch.device("cuda"), HEAD_DIM, None)


@pytest.mark.parametrize("amx", [False, True])
def test_cpu_sdpa_computes_bfloat16_natively_only_on_cpus_with_amx(monkeypatch, amx) -> None:
    """On AMX, PyTorch's bfloat16 attention is several times faster than the float32 upcast;
    without it, several times slower."""
    monkeypatch.setattr(attention_module, "has_amx_bf16", lambda: amx)
    (sdpa,) = select_backends(CPU, 24, None)
    assert isinstance(sdpa, SdpaAttention) and sdpa.cpu_native is amx
    kernels_first, _ = select_backends(CPU, HEAD_DIM, FAKE_OPS)
    assert isinstance(kernels_first, CpuKernelAttention) and kernels_first.sdpa_dense is amx
    attn = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM)  # handing the kernels out and back in
    attn.backends = select_backends(CPU, HEAD_DIM, FAKE_OPS)
    attn.cpu_ops = None
    attn.cpu_ops = FAKE_OPS
    assert attn.backends[0].sdpa_dense is amx
    computed_in = []
    call = attention_module._sdpa_call

    def recording(q, *args):
        computed_in.append(q.dtype)
        return call(q, *args)

    monkeypatch.setattr(attention_module, "_sdpa_call", recording)
    q = torch.randn(1, HEADS, 5, 24).to(torch.bfloat16)
    kv = torch.randn(1, KV_HEADS, 5, 24).to(torch.bfloat16)
    layer = PagedAttention(0, HEADS, KV_HEADS, 24).layer
    assert sdpa._sdpa(q, kv, kv, None, True, layer).dtype == torch.bfloat16
    half = sdpa._sdpa(q.half(), kv.half(), kv.half(), None, True, layer)
    assert half.dtype == torch.float16
    # float16 is upcast everywhere: only bfloat16 was measured faster natively
    assert computed_in == [torch.bfloat16 if amx else torch.float32, torch.float32]


def test_pick_backend_refuses_a_batch_no_backend_takes() -> None:
    fb = _batch(ForwardMode.EXTEND, [0], [5])
    assert pick_backend([Recording(), SdpaAttention()], fb).name == "sdpa"
    with pytest.raises(ValueError, match="no attention backend takes this EXTEND batch"):
        pick_backend([Recording()], fb)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_the_kernels_and_sdpa_agree_on_every_batch(monkeypatch, case, dtype, atol) -> None:
    """Whichever backend a batch goes to, the attention is the same: the kernels and SDPA
    (with its float32 upcast for bfloat16, and without it, as on CPUs with AMX) on one pool,
    including batches the kernels leave; and the kernels with their requests of many queries
    handed to SDPA (as on CPUs with AMX in bfloat16; here from 4 queries on)."""
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    mode, prefix_lens, extend_lens, _ = CASES[case]
    fb = _batch(mode, prefix_lens, extend_lens)
    gen = torch.Generator().manual_seed(len(case))
    kv = KVCache(200, 2, KV_HEADS, HEAD_DIM, dtype, CPU)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    num_tokens = fb.input_ids.numel()
    # q, k and v as the model hands them over: views of one qkv projection's rows
    widths = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    qkv = torch.randn(num_tokens, sum(widths), generator=gen)
    qkv[:, : widths[0]] *= 3
    q, k, v = (t.view(num_tokens, -1, HEAD_DIM) for t in qkv.to(dtype).split(widths, dim=-1))
    assert num_tokens == 1 or q.stride(0) == sum(widths)  # no backend may assume H * D
    layer = PagedAttention(1, HEADS, KV_HEADS, HEAD_DIM).layer
    kv.write(layer.layer_id, fb.out_cache_loc, k, v)
    with torch.inference_mode():
        got = CpuKernelAttention(ops).forward(q, k, v, fb, kv, layer)
        want = SdpaAttention().forward(q, k, v, fb, kv, layer)
        native = SdpaAttention(cpu_native=True).forward(q, k, v, fb, kv, layer)
        monkeypatch.setattr(CpuKernelAttention, "DENSE_MIN_QUERIES", 4)
        calls = []
        call = attention_module._sdpa_call
        monkeypatch.setattr(
            attention_module, "_sdpa_call", lambda *a: calls.append(a[3]) or call(*a)
        )
        no_amx = CpuKernelAttention(ops, sdpa_dense=True)
        no_amx._amx = False  # as on CPUs without AMX tiles: SDPA a long request
        split = no_amx.forward(q, k, v, fb, kv, layer)
        sdpa_calls = list(calls)
        amx = CpuKernelAttention(ops, sdpa_dense=True).forward(q, k, v, fb, kv, layer)
    assert got.shape == want.shape == native.shape == split.shape == (num_tokens, HEADS * HEAD_DIM)
    assert got.dtype == want.dtype == native.dtype == split.dtype == amx.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    torch.testing.assert_close(native.float(), want.float(), atol=atol, rtol=0)
    torch.testing.assert_close(split.float(), want.float(), atol=atol, rtol=0)
    torch.testing.assert_close(amx.float(), want.float(), atol=atol, rtol=0)
    # one SDPA call a request of 4 queries or more, masked where it has a prefix (bfloat16 only);
    # with AMX tiles (`amx_attention`), none: the kernels' dense_attention_ takes them all
    many = [p > 0 for p, e in zip(prefix_lens, extend_lens, strict=True) if e >= 4]
    if mode == ForwardMode.DECODE or dtype == torch.float32:
        many = []
    # ... but a long fresh prompt alone, taken for AMX tiles, goes to SDPA whole in float32
    if (
        fb.is_causal_single
        and fb.max_q > CpuKernelAttention.MAX_FEW_QUERIES
        and dtype == torch.float32
    ):
        assert sdpa_calls == []  # no tiles: the kernels' own
        assert [mask is not None for mask in calls] == ([False] if ops.amx_attention() else [])
        return
    assert [mask is not None for mask in sdpa_calls] == many
    assert len(calls) == len(sdpa_calls) + (0 if ops.amx_attention() else len(many))


def test_a_backend_plugs_in_and_reads_this_steps_kv_from_the_pool() -> None:
    attn = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM)
    recording = Recording()
    attn.backends = [recording, SdpaAttention()]
    kv = KVCache(100, 1, KV_HEADS, HEAD_DIM, torch.float32, CPU)
    steps = [(ForwardMode.DECODE, [5, 9], [1, 1]), (ForwardMode.EXTEND, [0, 3], [4, 2])]
    first_ks = []
    for mode, prefix_lens, extend_lens in steps:
        fb = _batch(mode, prefix_lens, extend_lens)
        num_tokens = fb.input_ids.numel()
        q = torch.randn(num_tokens, HEADS, HEAD_DIM)
        k, v = torch.randn(2, num_tokens, KV_HEADS, HEAD_DIM)
        first_ks.append(k[0])
        out = attn(q, k, v, fb, kv)
        assert out.shape == (num_tokens, HEADS * HEAD_DIM)
        assert bool(out.eq(0).all()) == (mode == ForwardMode.DECODE)  # SDPA took the extend
    (seen,) = recording.seen  # decode only; the pool held this step's k when the backend ran
    assert torch.equal(seen, first_ks[0])


def test_the_cpu_ops_slot_hands_out_and_withdraws_only_the_kernels() -> None:
    attn = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM)
    shared = [Recording(), SdpaAttention()]  # one list for all layers, as the runner sets it
    attn.backends = shared
    assert attn.cpu_ops is None
    attn.cpu_ops = FAKE_OPS
    assert attn.cpu_ops is FAKE_OPS
    assert [b.name for b in attn.backends] == ["cpu-kernels", "recording", "sdpa"]
    attn.cpu_ops = None
    assert attn.backends == shared and [b.name for b in shared] == ["recording", "sdpa"]


@pytest.mark.parametrize(
    ("dtype", "want"), [(torch.float32, ["cpu-kernels", "sdpa"]), (torch.float16, ["sdpa"])]
)
def test_the_runner_chooses_one_list_of_backends_for_all_layers(tiny_llama_dir, dtype, want):
    assert kernels.cpu_ops() is not None, "the CPU kernels did not build (see the warning log)"
    runner = ModelRunner(ModelConfig.from_hf_dir(tiny_llama_dir), CPU, dtype, kv_size=64)
    lists = [m.backends for m in runner.model.modules() if isinstance(m, PagedAttention)]
    assert len(lists) == runner.cfg.num_hidden_layers
    assert all(b is lists[0] for b in lists) and [b.name for b in lists[0]] == want


@pytest.mark.parametrize("case", CASES)
def test_no_backend_reads_a_slot_outside_its_batch(case) -> None:
    """The CPU pool is not zeroed at start (KVCache: only slot 0, the padding slot, is), so a
    slot nobody wrote may hold anything. Here every slot the batch's requests do not own holds
    NaN, their rows of req_to_token name such a slot past their lengths (stale entries), and
    both backends' outputs stay finite: padding reads slot 0 only (ForwardBatch)."""
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    mode, prefix_lens, extend_lens, _ = CASES[case]
    owned = sum(prefix_lens) + sum(extend_lens)  # _batch's requests own slots 1..owned
    fb = _batch(mode, prefix_lens, extend_lens, stale=owned + 1)
    kv = KVCache(owned + 64, 1, KV_HEADS, HEAD_DIM, torch.float32, CPU)
    gen = torch.Generator().manual_seed(7)
    for t in kv.k + kv.v:
        assert bool(t[0].eq(0).all())
        t[1 : owned + 1] = torch.randn(owned, KV_HEADS, HEAD_DIM, generator=gen)
        t[owned + 1 :] = float("nan")
    num_tokens = fb.input_ids.numel()
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM).layer
    kv.write(layer.layer_id, fb.out_cache_loc, k, v)
    with torch.inference_mode():
        for backend in (CpuKernelAttention(ops), SdpaAttention()):
            out = backend.forward(q, k, v, fb, kv, layer)
            assert bool(torch.isfinite(out).all()), backend.name


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_cpu_pool_takes_memory_as_it_fills() -> None:
    """Making a large pool on the CPU writes only its padding slot (start-up used to zero the
    whole default pool: 6 s for 5.6 GiB); its memory is taken as slots are written."""
    layers, slots = 4, 48 * 1024  # 4 layers x 2 x 48K slots x 3 x 64 x 4 bytes = 288 MiB
    gc.collect()  # earlier tests' garbage freed now, not while this one measures
    before = _rss_bytes()
    kv = KVCache(slots, layers, KV_HEADS, HEAD_DIM, torch.float32, CPU)
    pool_bytes = sum(t.numel() * t.element_size() for t in kv.k + kv.v)
    assert pool_bytes > 256 * 2**20
    made = _rss_bytes()
    assert made - before < pool_bytes // 8
    for t in kv.k + kv.v:
        assert bool(t[0].eq(0).all())
        t.fill_(1.0)  # every page touched now
    assert _rss_bytes() - made > pool_bytes // 2


def test_a_decode_step_attends_over_a_shared_prefix_only_where_it_pays() -> None:
    """`shared_prefix` (cascade attention) with `sdpa_dense` (CPUs with AMX), in bfloat16, from
    SHARED_MIN_QUERIES requests sharing SHARED_MIN_SLOTS slots; 0 otherwise."""
    most, least = CpuKernelAttention.SHARED_MIN_QUERIES, CpuKernelAttention.SHARED_MIN_SLOTS

    def decode(num: int, shared: int) -> ForwardBatch:
        r2t = 1 + torch.arange(num * 512).view(num, 512)
        r2t[:, :shared] = r2t[0, :shared].clone()
        loc = torch.arange(num) + 10_000
        return ForwardBatch.decode(
            [1] * num, [shared + 5] * num, list(range(num)), loc, r2t.numpy()
        )

    amx, plain = CpuKernelAttention(FAKE_OPS, sdpa_dense=True), CpuKernelAttention(FAKE_OPS)
    bf16 = torch.bfloat16
    assert amx.shared_prefix(decode(most, least), bf16).slots == least
    assert amx.shared_prefix(decode(most, 300), bf16).slots == 300
    assert amx.shared_prefix(decode(most - 1, 300), bf16).slots == 0  # too few requests
    assert amx.shared_prefix(decode(most, least - 1), bf16).slots == 0  # too short a prefix
    assert amx.shared_prefix(decode(most, 300), torch.float32).slots == 0
    assert plain.shared_prefix(decode(most, 300), bf16).slots == 0  # no AMX
    # requests on prompts of their own from position least - 1 on: the others may share theirs
    fb = decode(most + 2, 300)
    fb.kv_indices[most:, least - 1] = 5000 + torch.arange(2)
    shared = amx.shared_prefix(fb, bf16)
    assert shared.slots == 300 and shared.requests.tolist() == list(range(most))
    fb = decode(most + 1, 300)
    fb.kv_indices[most - 3 :, least - 1] = 5000 + torch.arange(4)
    assert fb.shared_prefix(least).count == most - 3
    assert amx.shared_prefix(fb, bf16).slots == 0  # too few of them


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_an_extend_on_a_shared_prefix_is_attended_over_it_all_together(dtype, atol) -> None:
    """New tokens of requests on one cached prompt prefix (a system prompt: the radix cache
    holds its slots once), too many a request for the kernels' plain extend: with `sdpa_dense`
    (CPUs with AMX) the kernels take the batch, in bfloat16 through the shared prefix (cascade
    attention), in float32 handing it on to SDPA, and the result is SDPA's; without it SDPA
    takes it, as before. Members whose own cached slots outnumber the shared ones, or a batch
    most of whose tokens are not members', are not taken."""
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    shared, min_slots = 150, CpuKernelAttention.SHARED_MIN_SLOTS
    prefix_lens, extend_lens = [shared + 10, shared, shared + 3], [20, 17, 18]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    req_to_token = torch.zeros(3, max(seq_lens), dtype=torch.int64)
    start = 1 + shared
    new_slots = []
    for b, (p, n) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
        req_to_token[b, :shared] = torch.arange(1, 1 + shared)
        req_to_token[b, shared:n] = torch.arange(start, start + n - shared)
        new_slots.append(req_to_token[b, p:n])
        start += n - shared
    num_tokens = sum(extend_lens)
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, [0] * num_tokens, prefix_lens, extend_lens, torch.cat(new_slots),
        req_to_token, [0, 1, 2], [num_tokens - 1], CPU,
    )  # fmt: skip
    assert shared >= min_slots and fb.shared_prefix(min_slots).queries == num_tokens
    amx, plain = CpuKernelAttention(ops, sdpa_dense=True), CpuKernelAttention(ops)
    assert amx.supports(fb) and not plain.supports(fb)
    gen = torch.Generator().manual_seed(5)
    kv = KVCache(start + 10, 1, KV_HEADS, HEAD_DIM, dtype, CPU)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    q = (torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen) * 3).to(dtype)
    k, v = (torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
    layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM).layer
    kv.write(0, fb.out_cache_loc, k, v)
    prefixes = []

    class Watching:  # the kernels, noting the shared prefix each extend is given
        attention_head_dims = ops.attention_head_dims

        def extend_attention(self, *args):
            prefixes.append(args[7])
            return ops.extend_attention(*args)

    with torch.inference_mode():
        got = CpuKernelAttention(Watching(), sdpa_dense=True).forward(q, k, v, fb, kv, layer)
        want = SdpaAttention().forward(q, k, v, fb, kv, layer)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    assert prefixes == ([shared] if dtype == torch.bfloat16 else [])  # float32: SDPA's
    # the same requests with 2 * 150 + 1 own cached slots each past the shared ones: not taken
    longer = [p + 2 * shared + 1 for p in prefix_lens]
    r2t = torch.zeros(3, max(longer) + max(extend_lens), dtype=torch.int64)
    r2t[:, :shared] = torch.arange(1, 1 + shared)
    for b in range(3):
        r2t[b, shared:] = 1000 * (b + 1) + torch.arange(r2t.shape[1] - shared)
    spans = enumerate(zip(longer, extend_lens, strict=True))
    locs = torch.cat([r2t[b, p : p + e] for b, (p, e) in spans])
    long_own = ForwardBatch.build(
        ForwardMode.EXTEND, [0] * num_tokens, longer, extend_lens, locs, r2t, [0, 1, 2],
        [num_tokens - 1], CPU,
    )  # fmt: skip
    assert long_own.shared_prefix(min_slots).slots == shared and not amx.supports(long_own)
    # two more requests on prompts of their own, 60 new tokens each: the members' 55 tokens
    # are fewer than half, so the shared prefix does not pay either
    prefixes, news = [*prefix_lens, shared, shared], [*extend_lens, 60, 60]
    r2t = torch.zeros(5, shared + 60 + 20, dtype=torch.int64)
    r2t[:3, :shared] = torch.arange(1, 1 + shared)
    r2t[:3, shared:] = 5000 + torch.arange(3 * (r2t.shape[1] - shared)).view(3, -1)
    r2t[3:] = 9000 + torch.arange(2 * r2t.shape[1]).view(2, -1)
    locs = torch.cat(
        [r2t[b, p : p + e] for b, (p, e) in enumerate(zip(prefixes, news, strict=True))]
    )
    outsiders = ForwardBatch.build(
        ForwardMode.EXTEND, [0] * sum(news), prefixes, news, locs, r2t, list(range(5)),
        [sum(news) - 1], CPU,
    )  # fmt: skip
    assert amx._shared(outsiders).slots == shared and not amx._shared_pays(outsiders)
    # ... and where the kernels take a batch for AMX, a float32 model's is SDPA's
    assert amx.takes(fb, torch.bfloat16, HEAD_DIM) and not amx.takes(fb, torch.float32, HEAD_DIM)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_long_fresh_prompt_goes_to_amx_tiles_where_the_kernels_have_them(dtype, atol) -> None:
    """One fresh prompt of DENSE_MIN_QUERIES tokens or more: on a CPU with AMX tiles
    (`amx_attention`, with `sdpa_dense`) the kernels take it, through dense_attention_ in
    bfloat16 and through SDPA in other dtypes; elsewhere SDPA takes it, as before. Either way
    the result is SDPA's."""
    ops = kernels.cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    n = CpuKernelAttention.DENSE_MIN_QUERIES + 3
    fb = _batch(ForwardMode.EXTEND, [0], [n])
    assert fb.is_causal_single
    amx = CpuKernelAttention(ops, sdpa_dense=True)
    assert amx.supports(fb) == ops.amx_attention()
    assert not CpuKernelAttention(ops).supports(fb)  # no AMX: SDPA's, as before
    assert not CpuKernelAttention(FAKE_OPS, sdpa_dense=True).supports(fb)  # no amx_attention
    gen = torch.Generator().manual_seed(3)
    kv = KVCache(n + 8, 1, KV_HEADS, HEAD_DIM, dtype, CPU)
    q = (torch.randn(n, HEADS, HEAD_DIM, generator=gen) * 3).to(dtype)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
    layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM).layer
    kv.write(0, fb.out_cache_loc, k, v)
    with torch.inference_mode():
        got = amx.forward(q, k, v, fb, kv, layer)
        want = SdpaAttention().forward(q, k, v, fb, kv, layer)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
