"""KVCache: the K and V tensors of every layer, indexed by token slot.

Slot 0 is a dummy slot that padding reads from; the scheduler's allocator hands out 1..size.
Which slot belongs to whom is the scheduler's business (memory_pool, radix_cache); this class only
stores and gathers.
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    # sluice's CPU kernels, for `write` (the runner's, set at load); None: PyTorch's index_copy_
    cpu_ops: Any | None = None

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        shape = (size + 1, num_kv_heads, head_dim)  # [slots, Hkv, D]
        # Slot 0 must hold zeros: padded reads see it, and NaN garbage there would spread
        # through masked attention (0 * NaN). Every other slot is written in the step that is
        # handed it, before anything reads it (test_attention.py holds the backends to it). On
        # the CPU the rest is left unwritten: a large pool's pages are fresh mappings, given
        # (zeroed by the kernel) on first touch, so start-up does not write all of it
        # (torch.zeros took 6 s for the default 5.6 GiB pool on 2 cores) and memory is taken
        # as the pool fills; a small one may hold old data. Other devices zero it all.
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T] int64, distinct slots; k/v: [T, Hkv, D], rows at any stride (the qkv
        # projection's views); with `cpu_ops` (store_kv_) each row's Hkv * D values consecutive
        if self.cpu_ops is not None:
            self.cpu_ops.store_kv_(self.k[layer], self.v[layer], loc, k, v)
            return
        self.k[layer].index_copy_(0, loc, k)
        self.v[layer].index_copy_(0, loc, v)

    def gather(self, layer: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # indices: [B, L] -> [B, L, Hkv, D]
        flat = indices.reshape(-1)
        shape = (*indices.shape, *self.k[layer].shape[1:])
        k = self.k[layer].index_select(0, flat).view(shape)
        v = self.v[layer].index_select(0, flat).view(shape)
        return k, v
