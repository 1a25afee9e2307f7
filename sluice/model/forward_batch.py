"""ForwardBatch: the metadata of one model forward, built once per batch and passed down.

The scheduler decides what to run; `ForwardBatch.build` turns that into tensors. Every layer
reads the same metadata; nothing is stored on modules between calls.

PyTorch attention runs on padded per-request views: queries [B, H, max_q, D] against keys
gathered from the KV pool through `kv_indices` [B, max_kv]; `attn_mask` [B, 1, max_q, max_kv]
marks what each query may see (its request's prefix and the causal part of its own extend).
sluice's CPU kernels read the pool in place instead, query by query: `q_rows` and `q_seq_lens`
say which row of `kv_indices` each new token reads and how much of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sluice.model.multimodal import ImageSpan, MultimodalInputs


class ForwardMode(enum.Enum):
    EXTEND = 1  # prefill (possibly one chunk, possibly on top of a cached prefix)
    DECODE = 2  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, request-major
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token writes
    kv_indices: torch.Tensor  # [B, max_kv] int64, slots each request reads (0-padded)
    seq_lens: torch.Tensor  # [B] int64, tokens each request attends to (prefix + extend)
    attn_mask: torch.Tensor | None  # [B, 1, max_q, max_kv] bool; None: no padding at all
    max_q: int
    q_pad_index: torch.Tensor | None  # [B * max_q] -> index into T (EXTEND only)
    q_unpad_index: torch.Tensor | None  # [T] -> index into B * max_q (EXTEND only)
    logits_index: torch.Tensor  # [N] rows of T whose logits are computed
    q_rows: torch.Tensor | None = None  # [T] -> request (row of kv_indices) (EXTEND on CPU)
    q_seq_lens: torch.Tensor | None = None  # [T] keys each token sees: position + 1 (same)
    # EXTEND: the share of the padded [B, max_q, max_kv] attention that the mask lets through;
    # PyTorch's SDPA computes all of it, sluice's kernel only that share (DECODE: not used, 1)
    mask_density: float = 1.0
    mm_inputs: MultimodalInputs | None = None  # images with positions in this forward; None: none

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: list[int],
        logits_index: list[int],
        device: torch.device,
        images: list[list[ImageSpan]] | None = None,
    ) -> ForwardBatch:
        """prefix_lens[b]: tokens of request b already in the KV pool; extend_lens[b]: new tokens
        (1 for DECODE). The new tokens' slots must already be written into `req_to_token`.
        images[b]: request b's images (sluice.model.multimodal), None for text only."""
        bs = len(extend_lens)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        max_kv, max_q = max(seq_lens), max(extend_lens)
        rows = torch.tensor(req_pool_indices, dtype=torch.int64)
        kv_indices = req_to_token[rows, :max_kv]
        seq_t = torch.tensor(seq_lens, dtype=torch.int64)
        positions = _positions(prefix_lens, extend_lens)
        attn_mask = None
        q_pad = q_unpad = q_rows = q_seq_lens = None
        mask_density = 1.0
        if mode == ForwardMode.DECODE:
            if min(seq_lens) != max_kv:
                attn_mask = (torch.arange(max_kv) < seq_t[:, None]).view(bs, 1, 1, max_kv)
        else:
            ext_t = torch.tensor(extend_lens, dtype=torch.int64)
            pre_t = torch.tensor(prefix_lens, dtype=torch.int64)
            q_pos = torch.arange(max_q)
            # query i of request b sits at position prefix_b + i and sees keys j <= that
            attn_mask = torch.arange(max_kv)[None, None, :] <= (
                pre_t[:, None, None] + q_pos[None, :, None]
            )
            valid_q = q_pos[None, :] < ext_t[:, None]  # [B, max_q]
            # padded queries see only key 0, so their (discarded) softmax rows stay finite
            attn_mask &= valid_q[:, :, None]
            attn_mask[:, :, 0] |= ~valid_q
            attn_mask = attn_mask.unsqueeze(1)
            starts = torch.cumsum(ext_t, 0) - ext_t
            q_pad = (starts[:, None] + q_pos[None, :]).clamp(max=max(len(input_ids) - 1, 0))
            q_pad = torch.where(valid_q, q_pad, 0).view(-1)
            q_unpad = (torch.arange(bs)[:, None] * max_q + q_pos[None, :])[valid_q]
            pairs = zip(prefix_lens, extend_lens, strict=True)
            seen = sum(e * p + e * (e + 1) // 2 for p, e in pairs)
            mask_density = seen / (bs * max_q * max_kv)
            if device.type == "cpu":  # only sluice's CPU kernels read them
                q_rows = torch.repeat_interleave(torch.arange(bs), ext_t)
                q_seq_lens = positions + 1
            if bs == 1 and prefix_lens[0] == 0:
                attn_mask = None  # a single fresh prompt: plain causal attention
        mm_inputs = None
        if images is not None:
            mm_inputs = MultimodalInputs.build(images, prefix_lens, extend_lens, device)
        return cls(
            mode=mode,
            batch_size=bs,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            out_cache_loc=out_cache_loc.to(device),
            kv_indices=kv_indices.to(device),
            seq_lens=seq_t.to(device),
            attn_mask=None if attn_mask is None else attn_mask.to(device),
            max_q=max_q,
            q_pad_index=None if q_pad is None else q_pad.to(device),
            q_unpad_index=None if q_unpad is None else q_unpad.to(device),
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=device),
            q_rows=q_rows,
            q_seq_lens=q_seq_lens,
            mask_density=mask_density,
            mm_inputs=mm_inputs,
        )

    @property
    def is_causal_single(self) -> bool:
        return self.mode == ForwardMode.EXTEND and self.attn_mask is None


@dataclass
class ForwardOutput:
    """What one forward computes for the rows in `ForwardBatch.logits_index`."""

    logits: torch.Tensor  # [N, vocab]
    # [N, hidden], final-norm hidden states of the same rows; None where not asked for
    hidden: torch.Tensor | None


def _positions(prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
    if all(e == 1 for e in extend_lens):
        return torch.tensor(prefix_lens, dtype=torch.int64)
    return torch.cat(
        [
            torch.arange(p, p + e, dtype=torch.int64)
            for p, e in zip(prefix_lens, extend_lens, strict=True)
        ]
    )
