"""ForwardBatch: the metadata of one model forward, built once per batch and passed down.

The scheduler decides what to run; `ForwardBatch.build` turns that into tensors. Every layer
reads the same metadata; nothing is stored on modules between calls.

PyTorch attention runs on padded per-request views: queries [B, H, max_q, D] against keys
gathered from the KV pool through `kv_indices` [B, max_kv]; `padded()` gives the mask of what
each query may see (its request's prefix and the causal part of its own extend) and the maps
between the flat and the padded queries. They are built at the first `padded()` call, so a
batch that sluice's CPU kernels take never pays for them: those read the pool in place, query
by query, and `q_rows` and `q_seq_lens` say which row of `kv_indices` each new token reads and
how much of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from sluice.model.multimodal import ImageSpan, MultimodalInputs


class ForwardMode(enum.Enum):
    EXTEND = 1  # prefill (possibly one chunk, possibly on top of a cached prefix)
    DECODE = 2  # one new token per request


@dataclass(frozen=True)
class PaddedQueries:
    """SDPA's padded view of a batch (`ForwardBatch.padded`). EXTEND: the queries laid out
    [B, max_q]; DECODE: one query a request, so only the mask."""

    # [B, 1, max_q, max_kv] bool, what each padded query sees; None: nothing is padded
    attn_mask: torch.Tensor | None
    q_pad_index: torch.Tensor | None  # [B * max_q] -> index into T (EXTEND only)
    q_unpad_index: torch.Tensor | None  # [T] -> index into B * max_q (EXTEND only)


@dataclass(frozen=True)
class DenseSplit:
    """An extend's requests of many new tokens apart from its other queries
    (`ForwardBatch.dense_split`), for a backend that attends to each such request on its own."""

    # per such request: [start, end) of its tokens in T, and, where it has a prefix, the slots
    # it reads [S] and what each of its queries sees [end - start, S], as an additive mask (0
    # where seen, -inf elsewhere: SDPA would convert a boolean one on every layer) (None: a
    # fresh prompt, plain causal over its own new tokens; or a split built without masks)
    requests: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]
    rest: torch.Tensor | None  # [R] the other tokens' rows of T; None: there are none
    rest_rows: torch.Tensor | None  # [R] their request (row of kv_indices)
    rest_seq_lens: torch.Tensor | None  # [R] the keys each sees
    # [len(requests), 4] int64: per such request its row of kv_indices, its first token in T,
    # its new tokens, its prefix (the kernels' dense_attention_ spans)
    spans: torch.Tensor | None = None
    masks: bool = True  # built with the masks and slots (`dense_split`'s `masks`)


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """A CPU batch's first `slots` KV slots that the requests `requests` names (increasing
    indices, int64; None: every request) all read alike, all of them before each one's new
    tokens (so each new token sees more than them); `queries`: those requests' new tokens.
    slots 0: none."""

    slots: int = 0
    requests: torch.Tensor | None = None
    queries: int = 0

    @property
    def count(self) -> int | None:
        """How many requests share it (None: every request of the batch)."""
        return None if self.requests is None else int(self.requests.shape[0])


NO_SHARED_PREFIX = SharedPrefix()


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, request-major
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token writes
    kv_indices: torch.Tensor  # [B, max_kv] int64, slots each request reads (0-padded)
    seq_lens: torch.Tensor  # [B] int64, tokens each request attends to (prefix + extend)
    max_q: int
    logits_index: torch.Tensor  # [N] rows of T whose logits are computed
    # [B] int64 on the CPU each, what `padded()` is built from
    prefix_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor
    is_causal_single: bool = False  # EXTEND of one fresh prompt: plain causal attention
    q_rows: torch.Tensor | None = None  # [T] -> request (row of kv_indices) (EXTEND on CPU)
    q_seq_lens: torch.Tensor | None = None  # [T] keys each token sees: position + 1 (same)
    # EXTEND: the share of the padded [B, max_q, max_kv] attention that the mask lets through;
    # PyTorch's SDPA computes all of it, sluice's kernel only that share (DECODE: not used, 1)
    mask_density: float = 1.0
    mm_inputs: MultimodalInputs | None = None  # images with positions in this forward; None: none
    all_logits: bool = False  # `logits_index` is known to be every row of T, in order
    _padded: PaddedQueries | None = field(default=None, repr=False)
    _dense: dict[tuple[int, torch.dtype, bool], DenseSplit | None] = field(
        default_factory=dict, repr=False
    )
    _shared_prefix: dict[int, SharedPrefix] = field(default_factory=dict, repr=False)

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
        if mode == ForwardMode.DECODE and images is None and req_to_token.device.type == "cpu":
            fb = cls.decode(
                input_ids, prefix_lens, req_pool_indices, out_cache_loc, req_to_token.numpy()
            )
            if logits_index != list(range(len(input_ids))):
                fb.logits_index = torch.tensor(logits_index, dtype=torch.int64)
                fb.all_logits = False
            return fb.to(device)
        bs = len(extend_lens)
        pre_t = torch.tensor(prefix_lens, dtype=torch.int64)
        ext_t = torch.tensor(extend_lens, dtype=torch.int64)
        seq_t = pre_t + ext_t
        max_kv, max_q = int(seq_t.max()), max(extend_lens)
        rows = torch.tensor(req_pool_indices, dtype=torch.int64)
        kv_indices = req_to_token[rows, :max_kv]  # a copy (rows is a tensor)
        # past a request's length its row holds stale slots (ReqToTokenPool), which may never
        # have been written (KVCache leaves them so): padding reads slot 0, zeroed in every
        # pool, since masked attention still multiplies what it reads (0 * NaN is NaN)
        kv_indices.masked_fill_(torch.arange(max_kv) >= seq_t[:, None], 0)
        positions = _positions(pre_t, ext_t, len(input_ids), max_q)
        q_rows = q_seq_lens = None
        mask_density = 1.0
        if mode == ForwardMode.EXTEND:
            # what query i of request b (at position prefix_b + i) sees: keys j <= that
            seen = int((ext_t * pre_t + ext_t * (ext_t + 1) // 2).sum())
            mask_density = seen / (bs * max_q * max_kv)
            if device.type == "cpu":  # only sluice's CPU kernels read them
                q_rows = torch.repeat_interleave(torch.arange(bs), ext_t)
                q_seq_lens = positions + 1
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
            max_q=max_q,
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=device),
            prefix_lens_cpu=pre_t,
            extend_lens_cpu=ext_t,
            is_causal_single=mode == ForwardMode.EXTEND and bs == 1 and prefix_lens[0] == 0,
            q_rows=q_rows,
            q_seq_lens=q_seq_lens,
            mask_density=mask_density,
            mm_inputs=mm_inputs,
            all_logits=len(logits_index) == len(input_ids)
            and logits_index == list(range(len(input_ids))),
        )

    @classmethod
    def decode(
        cls,
        input_ids: list[int],
        positions: list[int],
        rows: list[int],
        out_cache_loc: torch.Tensor,
        req_to_token: np.ndarray,
    ) -> ForwardBatch:
        """A DECODE batch, its tensors on the CPU and its logits for every row: request b's new
        token input_ids[b] at positions[b] (the tokens already in the pool), in row rows[b] of
        `req_to_token` (the CPU pool's NumPy view), where its slot out_cache_loc[b] is written
        here. Made with NumPy and one array for all the [B] rows: a PyTorch op costs tens of
        microseconds right after a forward has streamed the weights through the caches (about
        twenty of them made a decode step's metadata), NumPy's a few."""
        bs = len(rows)
        seq = [p + 1 for p in positions]
        meta = np.array(  # [6, B]
            [input_ids, positions, seq, rows, list(range(bs)), [1] * bs], dtype=np.int64
        )
        max_kv = max(seq)
        req_to_token[meta[3], meta[1]] = out_cache_loc.numpy()
        kv_indices = req_to_token[meta[3], :max_kv]  # a copy (rows are an array)
        if min(seq) < max_kv:  # pad with slot 0, as `build` does
            kv_indices[np.arange(max_kv) >= meta[2, :, None]] = 0
        ids, pos, seq_t, _, everyone, ones = torch.from_numpy(meta).unbind()
        return cls(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=ids, positions=pos,
            out_cache_loc=out_cache_loc, kv_indices=torch.from_numpy(kv_indices), seq_lens=seq_t,
            max_q=1, logits_index=everyone, prefix_lens_cpu=pos, extend_lens_cpu=ones,
            all_logits=True,
        )  # fmt: skip

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with its tensors on `device` (itself on the CPU; the *_cpu ones stay)."""
        if device.type == "cpu":
            return self
        for name in ("input_ids", "positions", "out_cache_loc", "kv_indices", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        self.logits_index = self.logits_index.to(device)
        return self

    def padded(self) -> PaddedQueries:
        """The padded view, built at the first call on the batch's device and kept: every layer
        of one forward reads the same one."""
        if self._padded is None:
            self._padded = _padded_queries(self)
        return self._padded

    def shared_prefix(self, min_slots: int) -> SharedPrefix:
        """DECODE or EXTEND on the CPU: the first slots, at least `min_slots` of them, that the
        largest group of requests holding the same slot at position min_slots - 1 all read
        alike (a common prompt prefix, which the radix cache holds once, a token a slot: two
        requests with one slot there share every slot before it), within each one's cached
        prefix (a new token's slot is its own); none for fewer than two such requests. Computed
        at the first call for `min_slots` and kept."""
        if min_slots not in self._shared_prefix:
            self._shared_prefix[min_slots] = _shared_prefix(self, max(min_slots, 1))
        return self._shared_prefix[min_slots]

    def dense_split(
        self, min_queries: int, mask_dtype: torch.dtype, masks: bool = True
    ) -> DenseSplit | None:
        """The requests with at least `min_queries` new tokens, and the rest of the batch's
        tokens (CPU EXTEND batches); None when no request has that many. Masks in
        `mask_dtype` (the queries'), and each prefixed request's slots, only with `masks` (an
        attention that reads the spans alone needs neither). Built at the first call and kept,
        as `padded`."""
        key = (min_queries, mask_dtype, masks)
        if key not in self._dense:
            self._dense[key] = _dense_split(self, min_queries, mask_dtype, masks)
        return self._dense[key]


def _shared_prefix(fb: ForwardBatch, min_slots: int) -> SharedPrefix:
    modes = (ForwardMode.DECODE, ForwardMode.EXTEND)
    if fb.mode not in modes or fb.batch_size < 2 or fb.kv_indices.device.type != "cpu":
        return NO_SHARED_PREFIX
    kv, cached = fb.kv_indices.numpy(), fb.prefix_lens_cpu.numpy()
    longer = np.flatnonzero(cached >= min_slots)  # each request keeps at least its new slots
    if len(longer) < 2:
        return NO_SHARED_PREFIX
    column = kv[longer, min_slots - 1]
    values, counts = np.unique(column, return_counts=True)
    members = longer[column == values[counts.argmax()]]  # increasing
    if len(members) < 2:
        return NO_SHARED_PREFIX
    head = kv[members, : int(cached[members].min())]
    same = (head == head[0]).all(axis=0)  # the column is one slot for every member
    slots = len(same) if same.all() else int(same.argmin())
    if slots < min_slots:  # slots shared other than through the radix cache's tree
        return NO_SHARED_PREFIX
    every = len(members) == fb.batch_size
    queries = int(fb.extend_lens_cpu.numpy()[members].sum())
    requests = None if every else torch.from_numpy(members.astype(np.int64))
    return SharedPrefix(slots, requests, queries)


def _dense_split(
    fb: ForwardBatch, min_queries: int, mask_dtype: torch.dtype, masks: bool
) -> DenseSplit | None:
    pre, ext = fb.prefix_lens_cpu.tolist(), fb.extend_lens_cpu.tolist()
    requests, spans, start, keep = [], [], 0, []
    for b, (p, e) in enumerate(zip(pre, ext, strict=True)):
        if e < min_queries:
            keep.append(torch.arange(start, start + e))
        elif p == 0 or not masks:
            requests.append((start, start + e, None, None))
        else:  # query i at position p + i sees keys j <= p + i
            unseen = torch.ones(e, p + e, dtype=torch.bool).triu(p + 1)
            seen = torch.zeros(e, p + e, dtype=mask_dtype).masked_fill_(unseen, float("-inf"))
            requests.append((start, start + e, fb.kv_indices[b, : p + e], seen))
        if e >= min_queries:
            spans.append((b, start, e, p))
        start += e
    if not requests:
        return None
    spans_t = torch.tensor(spans, dtype=torch.int64)
    if not keep:
        return DenseSplit(requests, None, None, None, spans_t, masks)
    rest = torch.cat(keep)
    assert fb.q_rows is not None and fb.q_seq_lens is not None
    return DenseSplit(requests, rest, fb.q_rows[rest], fb.q_seq_lens[rest], spans_t, masks)


def _padded_queries(fb: ForwardBatch) -> PaddedQueries:
    device = fb.seq_lens.device
    pre_t, ext_t = fb.prefix_lens_cpu, fb.extend_lens_cpu
    bs, max_q, max_kv = fb.batch_size, fb.max_q, fb.kv_indices.shape[1]
    seq_t = pre_t + ext_t
    if fb.mode == ForwardMode.DECODE:
        if int(seq_t.min()) == max_kv:
            return PaddedQueries(None, None, None)
        mask = (torch.arange(max_kv) < seq_t[:, None]).view(bs, 1, 1, max_kv)
        return PaddedQueries(mask.to(device), None, None)
    q_pos = torch.arange(max_q)
    # query i of request b sits at position prefix_b + i and sees keys j <= that
    mask = torch.arange(max_kv)[None, None, :] <= (pre_t[:, None, None] + q_pos[None, :, None])
    valid_q = q_pos[None, :] < ext_t[:, None]  # [B, max_q]
    # padded queries see only key 0, so their (discarded) softmax rows stay finite
    mask &= valid_q[:, :, None]
    mask[:, :, 0] |= ~valid_q
    num_tokens = int(ext_t.sum())
    starts = torch.cumsum(ext_t, 0) - ext_t
    q_pad = (starts[:, None] + q_pos[None, :]).clamp(max=max(num_tokens - 1, 0))
    q_pad = torch.where(valid_q, q_pad, 0).view(-1)
    q_unpad = (torch.arange(bs)[:, None] * max_q + q_pos[None, :])[valid_q]
    attn_mask = None if fb.is_causal_single else mask.unsqueeze(1).to(device)
    return PaddedQueries(attn_mask, q_pad.to(device), q_unpad.to(device))


@dataclass
class ForwardOutput:
    """What one forward computes for the rows in `ForwardBatch.logits_index`."""

    logits: torch.Tensor  # [N, vocab]
    # [N, hidden], final-norm hidden states of the same rows; None where not asked for
    hidden: torch.Tensor | None


def _positions(
    pre_t: torch.Tensor, ext_t: torch.Tensor, num_tokens: int, max_q: int
) -> torch.Tensor:
    """[T] int64: request b's new tokens sit at prefix_b, prefix_b + 1, ..."""
    if max_q == 1 and num_tokens == len(pre_t):  # one token a request (decode)
        return pre_t.clone()
    starts = torch.cumsum(ext_t, 0) - ext_t  # each request's first row of T
    offset = torch.repeat_interleave(pre_t - starts, ext_t, output_size=num_tokens)
    return torch.arange(num_tokens, dtype=torch.int64) + offset
