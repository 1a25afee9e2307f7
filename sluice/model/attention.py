"""Attention backends: the ways one layer's queries attend over the KV pool, behind one interface.

`PagedAttention` (layers.py) writes a step's K/V into the pool, then hands the batch to the first
of its backends whose `supports(fb)` holds (`pick_backend`). The runner chooses that list once at
load (`select_backends`), in order of preference; a new backend (a paged CUDA kernel, a kernel over
a quantized pool) is a class here and an entry in `select_backends`, not a change to the models.

Guarantees:
- a backend's `forward` returns [T, H * D] in q's dtype, row t being query t's attention over
  its request's slots up to its own position (the pool already holds this step's K/V);
- which backend takes a batch depends on the batch's metadata (`ForwardBatch`) alone, never on
  the layer or on state kept between calls;
- every list `select_backends` returns ends in `SdpaAttention`, which takes every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sluice.model.forward_batch import NO_SHARED_PREFIX, ForwardBatch, ForwardMode, SharedPrefix
from sluice.model.kv_cache import KVCache
from sluice.utils import envs
from sluice.utils.system import has_amx_bf16

_SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def cuda_sdpa_backends() -> list[SDPBackend]:
    """The SDPA kernels allowed on CUDA, from SLUICE_CUDA_SDPA."""
    names = [n.strip() for n in (envs.get_str("SLUICE_CUDA_SDPA") or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in _SDPA_BACKENDS]
    if unknown or not names:
        raise ValueError(
            f"SLUICE_CUDA_SDPA={','.join(names)!r}: give a comma-separated list of "
            f"{', '.join(_SDPA_BACKENDS)}"
        )
    return [_SDPA_BACKENDS[n] for n in names]


@dataclass(frozen=True)
class AttentionLayer:
    """What a backend knows of the layer it computes: backends are shared by all layers."""

    layer_id: int  # which of the KV pool's layers to read
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionBackend(Protocol):
    """One way to compute attention. Holds only what was chosen at load (compiled kernels, the
    allowed SDPA kernels), so one instance serves every layer and every batch."""

    name: str  # for the log line that says what the runner chose

    def supports(self, fb: ForwardBatch) -> bool:
        """Whether this backend takes `fb`: it can compute it, and is preferred for it."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        kv: KVCache,
        layer: AttentionLayer,
    ) -> torch.Tensor:
        """q [T, H, D] and this step's k/v [T, Hkv, D], already written into `kv` at
        `fb.out_cache_loc` -> [T, H * D]."""
        ...


def pick_backend(backends: list[AttentionBackend], fb: ForwardBatch) -> AttentionBackend:
    """The first of `backends` that takes `fb`."""
    for backend in backends:
        if backend.supports(fb):
            return backend
    names = ", ".join(b.name for b in backends) or "none"
    raise ValueError(f"no attention backend takes this {fb.mode.name} batch (backends: {names})")


def select_backends(
    device: torch.device, head_dim: int, cpu_ops: Any | None
) -> list[AttentionBackend]:
    """The backends of a model on `device`, in order of preference: sluice's C++ kernels where
    `cpu_ops` (the runner's, for this device and dtype, or None) are compiled for `head_dim`,
    then SDPA. On CUDA, SLUICE_CUDA_SDPA is read (and checked) here, at start-up."""
    if device.type == "cuda":
        sdpa = SdpaAttention(cuda_sdpa_backends())
    else:
        sdpa = SdpaAttention(cpu_native=has_amx_bf16())
    if cpu_ops is not None and head_dim in cpu_ops.attention_head_dims:
        return [CpuKernelAttention(cpu_ops, sdpa_dense=sdpa.cpu_native), sdpa]
    return [sdpa]


class CpuKernelAttention:
    """sluice's C++ CPU kernels (`sluice.model.kernels.cpu_ops()`): they read each request's K/V
    rows in place, query by query, in float32 or bfloat16. They take decode; extends whose
    requests bring few queries each (decoding rows beside a prompt's last token, short chunks on
    cached prefixes: SDPA's matmuls have no queries to share a key over, and it pays for the
    gather and the float32 casts); and prefills whose padded attention would be mostly masked
    (several prompts of different lengths). Dense prefills (one fresh prompt, or a long chunk
    on a long prefix) are left to SDPA's blocked matmuls, which are faster there, but on CPUs
    with AMX in bfloat16: there the kernels' own AMX attention takes long requests, a lone
    fresh prompt among them, and extends on a prefix most of whose slots their requests share
    (cascade attention); in another dtype such a batch goes on to SDPA (`_handed_on`)."""

    name = "cpu-kernels"

    # the kernel takes a prefill when less than this share of the padded attention is real:
    # measured on SmolLM2's shapes on a Zen 4 (16-lane build), SDPA is 1.4-2.8x slower at 0.5
    # and up to 1.4x faster at 0.75 and above
    MAX_MASK_DENSITY = 0.7
    # ... and whatever the share when no request brings more queries than this: on SmolLM2's
    # shapes in bfloat16 on a Xeon (model 207, one thread), SDPA took 1.1-6x the kernel's CPU
    # time at 1 to 16 queries a request (at densities up to 1.0), about as much at 32, and
    # 0.7x at 64 and more on a long prefix
    MAX_FEW_QUERIES = 16
    # with `sdpa_dense` (bfloat16 on CPUs with AMX), the requests of at least this many new
    # tokens in an extend the kernels take go, causal, to the kernels' AMX attention all in one
    # call (`dense_attention_`; where it is not there, to PyTorch's SDPA one by one: a fresh
    # prompt over its new K/V, a chunk on a prefix over its gathered slots, masked), the rest of
    # the batch to the plain kernels. On a Xeon (lscpu model 167), 30 layers of fresh prompts
    # side by side, plain kernels against the split through SDPA: 64 x 40 tokens 68 against 146
    # ms, 64 x 75 172 against 256, 32 x 150 272 against 220, 8 x 512 559 against 256, 2 x 1024
    # 549 against 190; through the AMX kernel, 32 x ~150 in-process prefills 1.31-1.37 ->
    # 0.95-1.06 s against SDPA
    DENSE_MIN_QUERIES = 128
    # ... and the new tokens, at least SHARED_MIN_QUERIES of them, of requests whose first
    # slots, at least SHARED_MIN_SLOTS of them, are the same (a common prompt prefix; the
    # largest such group, `ForwardBatch.shared_prefix`) attend over those slots all together
    # (AMX tiles, or PyTorch's blocked attention), and over the rest query by query (the kernels'
    # shared_prefix and shared_requests; cascade attention). An extend takes that way only where
    # the shared slots are at least half of its members' cached ones and its members bring at
    # least half of its tokens (`_shared_pays`): past them each query's own slots go through the
    # plain kernels, slower than SDPA over long ones. On the Xeon (model 167), µs a layer
    # in bfloat16, plain against shared through PyTorch's attention: a decode step of 32
    # requests over 450 shared + 40 own slots 365 against 182, 32 over 128 + 40 132 / 95, 32
    # over 64 + 40 86 / 82, 8 over 450 + 40 95 / 77, 4 over 450 + 40 48 / 61 (through the AMX
    # kernel, 32 over 450 + 30: 203 -> 124)
    SHARED_MIN_QUERIES, SHARED_MIN_SLOTS = 8, 128

    def __init__(self, ops: Any, sdpa_dense: bool = False) -> None:
        self.ops = ops
        self.sdpa_dense = sdpa_dense
        self._amx: bool | None = None  # the kernels' amx_attention(), asked at first use
        # where a batch taken for bfloat16 on AMX comes in another dtype (`_handed_on`)
        self._sdpa = SdpaAttention(cpu_native=sdpa_dense)

    def supports(self, fb: ForwardBatch) -> bool:
        return self._plain(fb) or self._for_amx(fb)

    def _plain(self, fb: ForwardBatch) -> bool:
        """The batches the kernels take in any dtype."""
        if fb.mode == ForwardMode.DECODE or fb.max_q <= self.MAX_FEW_QUERIES:
            return True
        return not fb.is_causal_single and fb.mask_density < self.MAX_MASK_DENSITY

    def _for_amx(self, fb: ForwardBatch) -> bool:
        """The extends they take besides, for bfloat16 on CPUs with AMX (`sdpa_dense`): a lone
        fresh prompt of DENSE_MIN_QUERIES tokens or more where the AMX kernel is there, and an
        extend whose shared prefix pays (`_shared_pays`)."""
        if not self.sdpa_dense or fb.mode != ForwardMode.EXTEND:
            return False
        if fb.is_causal_single:
            return fb.max_q >= self.DENSE_MIN_QUERIES and self._amx_tiles()
        return self._shared_pays(fb)

    def _shared_pays(self, fb: ForwardBatch) -> bool:
        """An extend's shared prefix (`_shared`) of at least half of its members' cached slots,
        their new tokens at least half of the batch's."""
        shared = self._shared(fb)
        if not shared.slots:
            return False
        cached = (
            fb.prefix_lens_cpu if shared.requests is None else fb.prefix_lens_cpu[shared.requests]
        )
        return 2 * shared.slots >= float(cached.double().mean()) and 2 * shared.queries >= int(
            fb.extend_lens_cpu.sum()
        )

    def takes(self, fb: ForwardBatch, dtype: torch.dtype, head_dim: int) -> bool:
        """`supports`, knowing the queries' dtype and head_dim: False for a batch that forward
        would hand on to SDPA (`_handed_on`). The fused decode path asks this."""
        return self._plain(fb) or (self._for_amx(fb) and not self._handed_on(fb, dtype, head_dim))

    def _handed_on(self, fb: ForwardBatch, dtype: torch.dtype, head_dim: int) -> bool:
        """A batch `_for_amx` took that such queries cannot have there (another dtype; a lone
        prompt in a head_dim the AMX kernel does not take): SDPA's, as without AMX."""
        if self._plain(fb) or not self._for_amx(fb):
            return False
        if fb.is_causal_single:
            return not self._amx_dense(dtype, head_dim)
        return dtype != torch.bfloat16

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        kv: KVCache,
        layer: AttentionLayer,
    ) -> torch.Tensor:
        k_pool, v_pool = kv.k[layer.layer_id], kv.v[layer.layer_id]  # [slots, Hkv, D]
        if fb.mode == ForwardMode.DECODE:
            shared = self.shared_prefix(fb, q.dtype)
            out = self.ops.decode_attention(
                q.contiguous(), k_pool, v_pool, fb.kv_indices, fb.seq_lens, layer.scale,
                shared.slots, shared.requests,
            )  # fmt: skip  # [B, H, D]
        elif self._handed_on(fb, q.dtype, q.shape[-1]):
            return self._sdpa.forward(q, k, v, fb, kv, layer)
        else:
            split, shared = None, self.shared_prefix(fb, q.dtype)
            if self.sdpa_dense and q.dtype == torch.bfloat16:
                split = fb.dense_split(
                    self.DENSE_MIN_QUERIES, q.dtype, not self._amx_dense(q.dtype, q.shape[-1])
                )
            if split is None:
                out = self.ops.extend_attention(
                    q.contiguous(), k_pool, v_pool, fb.kv_indices, fb.q_rows, fb.q_seq_lens,
                    layer.scale, shared.slots, shared.requests,
                )  # fmt: skip  # [T, H, D]
            else:  # q as it comes (the qkv view): the AMX kernel reads its rows at their stride
                out = self._split_extend(q, k, v, k_pool, v_pool, fb, split, shared, layer)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _amx_dense(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernels' dense_attention_ takes such queries' long requests: bfloat16,
        head_dim 64 or 128, a build and a CPU with AMX tiles."""
        return dtype == torch.bfloat16 and head_dim in (64, 128) and self._amx_tiles()

    def _amx_tiles(self) -> bool:
        """The kernels' amx_attention(): built with AMX tiles, on a CPU that lets us use them."""
        if self._amx is None:
            probe = getattr(self.ops, "amx_attention", None)
            self._amx = bool(probe()) if probe is not None else False
        return self._amx

    def shared_prefix(self, fb: ForwardBatch, dtype: torch.dtype) -> SharedPrefix:
        """The slots a batch's requests (all, or a group of them) attend over all together (the
        kernels' shared_prefix and shared_requests): with `sdpa_dense`, in bfloat16, those of
        `_shared`; else none (slots 0)."""
        if not self.sdpa_dense or dtype != torch.bfloat16:
            return NO_SHARED_PREFIX
        return self._shared(fb)

    def _shared(self, fb: ForwardBatch) -> SharedPrefix:
        """`fb.shared_prefix`, where SHARED_MIN_QUERIES new tokens share SHARED_MIN_SLOTS."""
        if fb.mode == ForwardMode.DECODE and fb.batch_size < self.SHARED_MIN_QUERIES:
            return NO_SHARED_PREFIX  # (no need to look)
        shared = fb.shared_prefix(self.SHARED_MIN_SLOTS)
        if shared.queries < self.SHARED_MIN_QUERIES or shared.slots < self.SHARED_MIN_SLOTS:
            return NO_SHARED_PREFIX
        return shared

    def _split_extend(self, q, k, v, k_pool, v_pool, fb, split, shared, layer) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D], contiguous
        if self._amx_dense(
            q.dtype, q.shape[-1]
        ):  # every long request in one call, causal, on AMX tiles
            self.ops.dense_attention_(
                out, q, k_pool, v_pool, fb.kv_indices, split.spans, layer.scale
            )
            requests = []
        else:
            requests = split.requests
        assert not requests or split.masks, "an SDPA call needs the split's masks"
        for start, end, slots, seen in requests:
            if slots is None:  # a fresh prompt: causal over its own new K/V
                kr, vr = k[start:end], v[start:end]
            else:
                kr, vr = k_pool[slots], v_pool[slots]
            qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (q[start:end], kr, vr))
            got = _sdpa_call(qp, kp, vp, seen, slots is None, layer)  # [1, H, n, D]
            out[start:end] = got.squeeze(0).transpose(0, 1)
        if split.rest is not None:
            out[split.rest] = self.ops.extend_attention(
                q[split.rest], k_pool, v_pool, fb.kv_indices, split.rest_rows,
                split.rest_seq_lens, layer.scale, shared.slots, shared.requests,
            )  # fmt: skip
        return out


class SdpaAttention:
    """PyTorch's scaled_dot_product_attention; takes every batch. A single fresh prompt attends
    causally over its own k/v (nothing is gathered); any other batch gathers each request's slots
    into padded per-request views and masks them (`fb.padded()`).

    On CPU, dtypes other than float32 are computed in float32, but for bfloat16 where
    `cpu_native` (what select_backends gives CPUs with AMX). On CUDA, only the kernels in
    `cuda_backends` may run (SLUICE_CUDA_SDPA, read at first use where not given)."""

    name = "sdpa"

    def __init__(
        self, cuda_backends: list[SDPBackend] | None = None, cpu_native: bool = False
    ) -> None:
        self.cuda_backends = cuda_backends
        self.cpu_native = cpu_native

    def supports(self, fb: ForwardBatch) -> bool:
        return True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        kv: KVCache,
        layer: AttentionLayer,
    ) -> torch.Tensor:
        bs, h, d = fb.batch_size, layer.num_heads, layer.head_dim
        if fb.is_causal_single:
            qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H(kv), T, D]
            out = self._sdpa(qp, kp, vp, None, True, layer)
            return out.squeeze(0).transpose(0, 1).reshape(-1, h * d)
        k_all, v_all = kv.gather(layer.layer_id, fb.kv_indices)  # [B, max_kv, Hkv, D]
        kp, vp = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, Hkv, max_kv, D]
        pad = fb.padded()
        if fb.mode == ForwardMode.DECODE:
            qp = q.view(bs, 1, h, d).transpose(1, 2)  # [B, H, 1, D]
            return self._sdpa(qp, kp, vp, pad.attn_mask, False, layer).reshape(bs, h * d)
        qp = q[pad.q_pad_index].view(bs, fb.max_q, h, d).transpose(1, 2)  # [B, H, max_q, D]
        out = self._sdpa(qp, kp, vp, pad.attn_mask, False, layer)  # [B, H, max_q, D]
        out = out.transpose(1, 2).reshape(bs * fb.max_q, h * d)
        return out[pad.q_unpad_index]

    def _sdpa(self, q, k, v, mask, causal: bool, layer: AttentionLayer) -> torch.Tensor:
        # on CPU in float32 unless it has AMX: PyTorch's bfloat16 CPU attention was several times
        # slower than the casts plus float32 attention on CPUs without it (122 vs 31 ms per decode
        # step of SmolLM2 at 64), and several times faster with it (its blocked matmuls run on
        # AMX tiles; a Xeon, lscpu model 167: one 3000-token prompt's prefill 2.72 -> 1.37 s, a
        # layer's 32 x 30 queries over 480 slots 35 -> 4.7 ms)
        native = self.cpu_native and q.dtype == torch.bfloat16
        if q.device.type == "cpu" and q.dtype != torch.float32 and not native:
            out = self._sdpa(q.float(), k.float(), v.float(), mask, causal, layer)
            return out.to(q.dtype)
        if q.device.type != "cuda":
            return _sdpa_call(q, k, v, mask, causal, layer)
        if self.cuda_backends is None:
            self.cuda_backends = cuda_sdpa_backends()
        with sdpa_kernel(self.cuda_backends):
            return _sdpa_call(q, k, v, mask, causal, layer)


def _sdpa_call(q, k, v, mask, causal: bool, layer: AttentionLayer) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=layer.scale,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )  # fmt: skip
