"""Vectorised sampling and log-probabilities over a batch of logits (runs in the scheduler process).

`SamplingBatchInfo.build` turns the per-request `SamplingParams` of one batch into tensors once;
`sample` then works on the whole batch with no loop over requests, in this order:

1. logit processors on a copy of the logits (only when some request has one): repetition penalty
   (HF: divide positive / multiply negative logits of tokens seen in prompt or output), then the
   additive terms (logit_bias minus OpenAI frequency/presence penalties over output tokens), then
   -inf on the blocked tokens (stop ids below `min_new_tokens`), then -inf on the tokens a request's
   grammar does not allow (a grammar wins over `min_new_tokens`: a row that the two together
   leave with no token keeps the grammar's mask alone);
2. greedy rows (temperature 0 or top_k 1) take the argmax of the processed logits (the first
   index of the maximum, as `torch.argmax`; on the CPU by blocks, `greedy_argmax`);
3. sampling rows: temperature, top-k (on logits), softmax, top-p, min-p (on probabilities), and one
   inverse-CDF draw per row.

A grammar's bitmask is applied as it is, with no [G, V] float bias, by sluice's CPU kernels when
`sample` is given them (`kernels`, `sluice.model.kernels.cpu_ops()`), else by PyTorch ops with the
same result; a batch of greedy rows with no processor but grammars takes the argmax of the
allowed logits directly (`masked_argmax`), without writing a masked copy.

Reproducibility: the only randomness of a request at output step t is one uniform number derived
from (seed, t) by a counter-based hash, so a seeded request picks the same token whatever batch it
is in and whatever its row; every other step works row by row. Log-probabilities are always those
of the raw logits (before processors, grammar masks and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from sluice.messages import SamplingParams

GREEDY_EPS = 1e-5  # temperatures below this are greedy
# top-p looks for its cut among this many best tokens, then this many, before sorting a row
TOP_P_CANDIDATES = (256, 2048)
_MASK64 = (1 << 64) - 1
# the CPU's argmax over a row is an order of magnitude slower than its max: a row is searched as
# blocks of this many logits (one max per block, then an argmax within the best block)
ARGMAX_BLOCK = 1024
# logits dtypes that the CPU kernels' argmax_rows, finite_rows and greedy_rows take (bfloat16
# widens exactly)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class TopK(NamedTuple):
    values: torch.Tensor  # float32 [N, k] log-probabilities, sorted descending
    indices: torch.Tensor  # int64 [N, k] token ids


class SparseLogits(NamedTuple):
    """Entries (row, token) of a [B, V] logits tensor; each pair appears at most once."""

    rows: torch.Tensor  # int64 [M]
    cols: torch.Tensor  # int64 [M]
    values: torch.Tensor  # float32 [M]; meaning depends on the processor


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B], raw log-softmax at the chosen token
    top_logprobs: TopK | None  # raw top-k when max_top_k > 0


@dataclass
class SamplingBatchInfo:
    """Everything the sampler needs for one batch, built once per batch.

    Rows that sample (not greedy) are the S rows `sample_rows` (None: all B rows); the per-row
    sampling tensors below have S rows, in that order. A batch of greedy rows has none of them
    (None), nothing reads them there.
    """

    batch_size: int
    vocab_size: int
    is_all_greedy: bool
    sample_rows: torch.Tensor | None  # int64 [S] rows of the batch that sample
    temperatures: torch.Tensor | None  # float32 [S, 1]
    uniforms: torch.Tensor | None  # float32 [S] in (0, 1): this step's random draw of each row
    top_ks: torch.Tensor | None  # int64 [S], 0 = off; None: no row uses top-k
    max_top_k: int
    top_ps: torch.Tensor | None  # float32 [R] for rows `top_p_rows`; None: no row uses top-p
    top_p_rows: torch.Tensor | None  # int64 [R] indices into the S rows; None: all S rows
    min_ps: torch.Tensor | None  # float32 [S, 1], 0 = off; None: no row uses min-p
    repetition: SparseLogits | None  # values: repetition penalty of the (row, token)
    additive: SparseLogits | None  # values: added to the logit
    blocked: SparseLogits | None  # (row, token) set to -inf; values unused
    grammar_rows: torch.Tensor | None = None  # int64 [G] rows constrained by a grammar
    grammar_masks: torch.Tensor | None = None  # int32 [G, ceil(V / 32)]: bit t set = t allowed

    @property
    def has_logit_processors(self) -> bool:
        return (
            self.repetition is not None or self.additive is not None or self.blocked is not None
            or self.grammar_rows is not None
        )  # fmt: skip

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        blocked_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        grammar_rows: list[int] | None = None,
        grammar_masks: torch.Tensor | None = None,
    ) -> SamplingBatchInfo:
        """`blocked_ids[i]`: tokens row i may not pick now (the stop ids, below min_new_tokens
        or while a grammar waits for the end of the reasoning); `grammar_masks` [G, ceil(V / 32)]
        are the bitmasks of the rows `grammar_rows`."""
        rows = [i for i, p in enumerate(params) if not _is_greedy(p)]
        sp = [params[i] for i in rows]
        top_ks = [_top_k(p, vocab_size) for p in sp]
        top_p_rows = [j for j, p in enumerate(sp) if p.top_p < 1.0]
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        temperatures = uniforms = None  # a greedy batch reads neither
        if rows:
            temperatures = torch.tensor([[p.temperature] for p in sp], **f32).reshape(-1, 1)
            draws = [step_uniform(seeds[i], len(output_ids[i])) for i in rows]
            uniforms = torch.tensor(draws, **f32)
        return cls(
            batch_size=len(params),
            vocab_size=vocab_size,
            is_all_greedy=not rows,
            sample_rows=None if len(rows) in (0, len(params)) else torch.tensor(rows, **i64),
            temperatures=temperatures,
            uniforms=uniforms,
            top_ks=torch.tensor(top_ks, **i64) if any(top_ks) else None,
            max_top_k=max(top_ks, default=0),
            top_ps=torch.tensor([sp[j].top_p for j in top_p_rows], **f32) if top_p_rows else None,
            top_p_rows=None if len(top_p_rows) == len(sp) else torch.tensor(top_p_rows, **i64),
            min_ps=torch.tensor([[p.min_p] for p in sp], **f32)
            if any(p.min_p > 0.0 for p in sp)
            else None,
            repetition=_build_repetition(params, prompt_ids, output_ids, vocab_size, device),
            additive=_build_additive(params, output_ids, vocab_size, device),
            blocked=_build_blocked(params, output_ids, blocked_ids, vocab_size, device),
            grammar_rows=torch.tensor(grammar_rows, **i64) if grammar_rows else None,
            grammar_masks=grammar_masks.to(device) if grammar_rows else None,
        )


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_EPS or p.top_k == 1


def is_plain_greedy(p: SamplingParams) -> bool:
    """Greedy, with no logit processor of its own (penalties, logit_bias): its token is the
    argmax of the raw logits, or with a grammar, of the raw logits the grammar allows."""
    return (
        _is_greedy(p) and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0 and not p.logit_bias
    )  # fmt: skip


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    """The row's top-k, 0 when it does not filter anything."""
    return p.top_k if 0 < p.top_k < vocab_size else 0


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_uniform(seed: int, step: int) -> float:
    """The uniform draw in (0, 1) of a request with `seed` at output step `step`.

    A function of (seed, step) only; 24 bits, so the value is exact in float32.
    """
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return ((h >> 40) + 0.5) / (1 << 24)


def _flat_keys(rows: list[int], id_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """Keys row * V + token for every id of id_lists[j] in row rows[j] (one tensor op per batch,
    not per request); ids outside the vocab (e.g. image placeholders) are skipped."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    flat = np.fromiter(chain.from_iterable(id_lists), dtype=np.int64, count=int(lengths.sum()))
    tokens = torch.from_numpy(flat)
    keys = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths) * vocab_size
    keys += tokens
    return keys[(tokens >= 0) & (tokens < vocab_size)].to(device)


def _unique_pairs(keys: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """Distinct (row, token) pairs of row-major keys, with how often each occurs."""
    uniq, counts = torch.unique(keys, return_counts=True)
    return uniq // vocab_size, uniq % vocab_size, counts


def _per_row(params: list[SamplingParams], field: str, device) -> torch.Tensor:
    return torch.tensor([getattr(p, field) for p in params], dtype=torch.float32, device=device)


def _build_repetition(params, prompt_ids, output_ids, vocab_size, device) -> SparseLogits | None:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return None
    id_lists = [ids for i in rows for ids in (prompt_ids[i], output_ids[i])]
    keys = _flat_keys([i for i in rows for _ in range(2)], id_lists, vocab_size, device)
    seen_rows, cols, _ = _unique_pairs(keys, vocab_size)
    factors = _per_row(params, "repetition_penalty", device)[seen_rows]
    return SparseLogits(seen_rows, cols, factors)


def _build_additive(params, output_ids, vocab_size, device) -> SparseLogits | None:
    """logit_bias minus (frequency * count + presence) over output tokens, one entry per pair."""
    keys, values = [], []
    rows = [
        i
        for i, p in enumerate(params)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output_ids[i]
    ]
    if rows:
        out_keys = _flat_keys(rows, [output_ids[i] for i in rows], vocab_size, device)
        seen_rows, cols, counts = _unique_pairs(out_keys, vocab_size)
        freq = _per_row(params, "frequency_penalty", device)[seen_rows]
        pres = _per_row(params, "presence_penalty", device)[seen_rows]
        keys.append(seen_rows * vocab_size + cols)
        values.append(-(freq * counts + pres))
    biases = [
        (i, int(t), b)
        for i, p in enumerate(params)
        for t, b in (p.logit_bias or {}).items()
        if 0 <= int(t) < vocab_size
    ]
    if biases:
        keys.append(torch.tensor([i * vocab_size + t for i, t, _ in biases], device=device))
        values.append(torch.tensor([b for *_, b in biases], dtype=torch.float32, device=device))
    if not keys:
        return None
    # at most two terms (penalty, bias) per pair, so the sum does not depend on the order
    uniq, inverse = torch.unique(torch.cat(keys), return_inverse=True)
    summed = torch.zeros(len(uniq), dtype=torch.float32, device=device)
    summed.index_add_(0, inverse, torch.cat(values))
    return SparseLogits(uniq // vocab_size, uniq % vocab_size, summed)


def _build_blocked(params, output_ids, blocked_ids, vocab_size, device) -> SparseLogits | None:
    rows = [i for i in range(len(params)) if blocked_ids[i]]
    if not rows:
        return None
    keys = _flat_keys(rows, [blocked_ids[i] for i in rows], vocab_size, device)
    blocked_rows, cols, _ = _unique_pairs(keys, vocab_size)
    return SparseLogits(blocked_rows, cols, torch.empty(0, device=device))


def apply_logit_processors(
    logits: torch.Tensor, info: SamplingBatchInfo, kernels: Any | None = None
) -> torch.Tensor:
    """Penalties, bias and blocking on [B, V] logits; returns a new tensor, or `logits` itself
    when no request has a processor. The input is never modified."""
    if not info.has_logit_processors:
        return logits
    if _only_grammar_on_every_row(info, logits.shape[0]) and not _kernels_fit(
        kernels, logits, info.grammar_masks
    ):  # one pass, not a copy and an add
        return logits + grammar_bias(info.grammar_masks.to(logits.device), logits.shape[1])
    out = logits.clone()
    if info.repetition is not None:
        rows, cols, factors = info.repetition
        seen = out[rows, cols]
        out[rows, cols] = torch.where(seen > 0, seen / factors, seen * factors)
    if info.additive is not None:
        rows, cols, values = info.additive
        out.index_put_((rows, cols), values, accumulate=True)
    if info.blocked is not None:
        out[info.blocked.rows, info.blocked.cols] = float("-inf")
    if info.grammar_rows is not None:
        _apply_grammar(
            out, logits, info.grammar_rows, info.grammar_masks, info.blocked is not None, kernels
        )
    return out


def _only_grammar(info: SamplingBatchInfo) -> bool:
    return (
        info.repetition is None and info.additive is None and info.blocked is None
        and info.grammar_rows is not None
    )  # fmt: skip


def _only_grammar_on_every_row(info: SamplingBatchInfo, num_rows: int) -> bool:
    return _only_grammar(info) and len(info.grammar_rows) == num_rows


# per byte value, the additive mask of its 8 tokens: 0 where the bit is set (allowed), -inf
# where not. A bitmask's int32 words are read as little-endian bytes (x86 and ARM are; byte k
# of word w holds tokens 32 * w + 8 * k ...): a table lookup and one add, where a masked_fill
# over [G, V] is several times slower on CPU
_BYTE_BIAS = torch.tensor(
    [[0.0 if (byte >> bit) & 1 else float("-inf") for bit in range(8)] for byte in range(256)]
)  # [256, 8]


def grammar_bias(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [G, vocab_size]: 0 where int32 bitmasks [G, ceil(vocab_size / 32)] allow a
    token (bit t of word w: token 32 * w + t), -inf where they do not."""
    table = _BYTE_BIAS.to(masks.device)
    codes = masks.contiguous().view(torch.uint8).view(-1).int()
    return table.index_select(0, codes).view(masks.shape[0], -1)[:, :vocab_size]


def _kernels_fit(kernels: Any | None, logits: torch.Tensor, masks: torch.Tensor) -> bool:
    """The CPU kernels can read these logits and bitmasks in place."""
    return (
        kernels is not None and logits.device.type == "cpu" and masks.device.type == "cpu"
        and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
        and masks.dtype == torch.int32
    )  # fmt: skip


def mask_grammar_(
    logits: torch.Tensor,
    masks: torch.Tensor,
    rows: torch.Tensor | None = None,
    kernels: Any | None = None,
) -> None:
    """-inf, in place, on the tokens that bitmask g [G, ceil(V / 32)] does not allow in row
    rows[g] of logits [B, V] (rows distinct; None: row g)."""
    if _kernels_fit(kernels, logits, masks):
        kernels.grammar_mask_(logits, masks.contiguous(), rows)
        return
    bias = grammar_bias(masks.to(logits.device), logits.shape[1])  # [G, V]
    if rows is None:
        logits.add_(bias)
    else:
        logits[rows] = logits[rows] + bias


def masked_argmax(
    logits: torch.Tensor,
    masks: torch.Tensor,
    rows: torch.Tensor | None = None,
    kernels: Any | None = None,
) -> torch.Tensor:
    """int64 [G]: the greedy token of row rows[g] of finite logits [B, V] (None: row g) among
    those bitmask g allows, as `greedy_argmax` of the masked row (the first index of the
    maximum; 0 where nothing is allowed). The logits are not modified."""
    if _kernels_fit(kernels, logits, masks):
        return kernels.masked_argmax(logits, masks.contiguous(), rows)
    sub = logits if rows is None else logits[rows]
    return greedy_argmax(sub + grammar_bias(masks.to(logits.device), logits.shape[1]))


def _apply_grammar(
    out: torch.Tensor,
    raw: torch.Tensor,
    rows: torch.Tensor,
    masks: torch.Tensor,
    blocked: bool,
    kernels: Any | None = None,
) -> None:
    """-inf, in place, on disallowed tokens of the grammar rows of `out`. With `blocked` tokens
    in the batch, a row left with no allowed token (min_new_tokens blocks the stop that is all
    the grammar allows) restarts from `raw`."""
    every_row = len(rows) == out.shape[0]  # rows are in order: the batch's grammar rows
    mask_grammar_(out, masks, None if every_row else rows, kernels)
    if blocked:
        empty = torch.isneginf(out[rows].amax(dim=-1))
        if bool(empty.any()):
            fresh = raw[rows[empty]]  # a copy
            mask_grammar_(fresh, masks[empty], None, kernels)
            out[rows[empty]] = fresh


def sample(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    max_top_k: int = 0,
    need_logprobs: bool = True,
    kernels: Any | None = None,
) -> SampleOutput:
    """Pick the next token of every row of `logits` [B, V] (float32). Without `need_logprobs`
    the returned logprobs are None (no full-vocab log-softmax is computed). `kernels`: sluice's
    CPU kernels for the grammar masks, or None (PyTorch ops, the same tokens)."""
    if info.is_all_greedy and _only_grammar(info):
        next_ids = _greedy_with_grammar(logits, info, kernels)
    elif info.is_all_greedy:
        next_ids = greedy_argmax(apply_logit_processors(logits, info, kernels), kernels)
    else:
        processed = apply_logit_processors(logits, info, kernels)
        if info.sample_rows is None:
            next_ids = _sample_rows(processed, info)
        else:
            next_ids = greedy_argmax(processed, kernels)
            next_ids[info.sample_rows] = _sample_rows(processed[info.sample_rows], info)
    if not need_logprobs:
        return SampleOutput(next_ids, None, None)
    logprobs, top = token_logprobs(logits, next_ids, max_top_k)
    return SampleOutput(next_ids, logprobs, top)


def _greedy_with_grammar(
    logits: torch.Tensor, info: SamplingBatchInfo, kernels: Any | None
) -> torch.Tensor:
    """Greedy tokens of a batch whose only processors are grammars: the masked argmax of the
    grammar rows, the plain one of the others."""
    rows, masks = info.grammar_rows, info.grammar_masks
    if len(rows) == logits.shape[0]:
        return masked_argmax(logits, masks, None, kernels)
    next_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    free = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    free[rows] = False
    next_ids[free] = greedy_argmax(logits[free], kernels)
    next_ids[rows] = masked_argmax(logits, masks, rows, kernels)
    return next_ids


def greedy_argmax(logits: torch.Tensor, kernels: Any | None = None) -> torch.Tensor:
    """int64 [R]: `logits.argmax(dim=-1)` of [R, V], the same index on ties (the first). With
    sluice's CPU kernels, float32 and bfloat16 logits take `argmax_rows` (one thread: two
    preempted torch threads were several times slower under load). Otherwise by blocks: the first block holding
    a row's maximum holds its first occurrence; a last block past V reads index V - 1 again,
    after the real one, so it never wins a tie."""
    rows, vocab = logits.shape
    if (
        kernels is not None
        and rows > 0
        and vocab > 1
        and logits.device.type == "cpu"
        and logits.dtype in KERNEL_DTYPES
    ):
        return kernels.argmax_rows(logits if logits.stride(1) == 1 else logits.contiguous())
    num_blocks = -(-vocab // ARGMAX_BLOCK)
    if logits.device.type != "cpu" or num_blocks < 2 or rows == 0:
        return logits.argmax(dim=-1)
    x = logits.contiguous()
    full = vocab // ARGMAX_BLOCK
    block_max = x.as_strided((rows, full, ARGMAX_BLOCK), (x.stride(0), ARGMAX_BLOCK, 1)).amax(-1)
    if full < num_blocks:
        block_max = torch.cat([block_max, x[:, full * ARGMAX_BLOCK :].amax(-1, keepdim=True)], 1)
    best = block_max.argmax(dim=-1, keepdim=True)  # [R, 1], the first block with the maximum
    cols = best * ARGMAX_BLOCK + torch.arange(ARGMAX_BLOCK, device=x.device)  # [R, block]
    cols.clamp_(max=vocab - 1)
    return cols.gather(1, x.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)


def _sample_rows(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """One draw per row from the filtered distribution; logits [S, V] of the sampling rows."""
    scaled = logits / info.temperatures  # [S, V], a fresh tensor owned here
    if info.top_ks is not None:
        _mask_top_k_(scaled, info.top_ks, info.max_top_k)
    probs = torch.softmax(scaled, dim=-1)
    if info.top_ps is not None or info.min_ps is not None:
        probs.masked_fill_(probs < _prob_cut(probs, info).unsqueeze(1), 0.0)
    return _draw(probs, info.uniforms)


def _mask_top_k_(logits: torch.Tensor, top_ks: torch.Tensor, max_top_k: int) -> None:
    """Keep the top_ks[i] best logits of row i (ties with the k-th are kept); 0 keeps all."""
    best = logits.topk(max_top_k, dim=-1).values  # [S, max_top_k], descending
    kth = best.gather(1, (top_ks.clamp(min=1) - 1).unsqueeze(1))
    kth.masked_fill_(top_ks.unsqueeze(1) == 0, float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _prob_cut(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Per row [S], the smallest probability kept by both top-p and min-p (0: keep all)."""
    cut = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    if info.top_ps is not None:
        rows = info.top_p_rows
        if rows is None:
            cut = _top_p_cut(probs, info.top_ps)
        else:
            cut[rows] = _top_p_cut(probs[rows], info.top_ps)
    if info.min_ps is not None:
        cut = torch.maximum(cut, info.min_ps.squeeze(1) * probs.amax(dim=-1))
    return cut


def _top_p_cut(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Per row [R], the probability of the last token of the smallest most-likely set whose mass
    reaches top_p. Each row is settled in the first tier of TOP_P_CANDIDATES best tokens that
    holds its cut, else by a full sort of the row; every path sees the same sorted prefix, so the
    cut does not depend on the path or on the other rows."""
    num_rows, vocab_size = probs.shape
    cut = torch.empty(num_rows, dtype=probs.dtype, device=probs.device)
    rest = torch.arange(num_rows, device=probs.device)  # rows not settled yet
    to_sort = [rest[:0]]  # rows that no tier can settle
    tiers = [k for k in TOP_P_CANDIDATES if k < vocab_size]
    for k, next_k in zip(tiers, tiers[1:] + [vocab_size], strict=False):
        desc = (probs if len(rest) == num_rows else probs[rest]).topk(k, dim=-1).values
        mass = desc.cumsum(dim=-1)  # [len(rest), k]
        row_cut, found = _cut_in_sorted(desc, mass, top_ps[rest])
        cut[rest[found]] = row_cut[found]
        # a row not settled needs at least (top_p - mass) / p_k more tokens, each at most p_k
        min_len = k + (top_ps[rest] - mass[:, -1]) / desc[:, -1]
        hopeless = ~found & (min_len > next_k)
        to_sort.append(rest[hopeless])
        rest = rest[~found & ~hopeless]
        if len(rest) == 0:
            break
    rest = torch.cat([*to_sort, rest])
    if len(rest) > 0:
        desc = probs[rest].sort(dim=-1, descending=True).values
        cut[rest] = _cut_in_sorted(desc, desc.cumsum(dim=-1), top_ps[rest])[0]
    return cut


def _cut_in_sorted(
    desc: torch.Tensor, mass: torch.Tensor, top_ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows sorted descending with running mass `mass`: the value where the mass first
    reaches top_p, and whether it does within these columns (if not: the last column's value)."""
    last = (mass < top_ps.unsqueeze(1)).sum(dim=-1)  # [R]
    found = last < desc.shape[1]
    cut = desc.gather(1, last.clamp(max=desc.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return cut, found


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised probs [S, V]; never picks a zero-probability token."""
    cdf = probs.cumsum(dim=-1)  # [S, V], per-row sequential so independent of the batch
    target = uniforms.unsqueeze(1) * cdf[:, -1:]  # in (0, total]
    ids = torch.searchsorted(cdf, target).squeeze(1)
    return ids.clamp_(max=probs.shape[1] - 1)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int = 0
) -> tuple[torch.Tensor, TopK | None]:
    """Raw log-softmax of logits [N, V] at token_ids [N], and the top_k best when top_k > 0."""
    logsoftmax = torch.log_softmax(logits, dim=-1)  # [N, V]
    logprobs = logsoftmax.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if top_k <= 0:
        return logprobs, None
    values, indices = logsoftmax.topk(min(top_k, logits.shape[1]), dim=-1)
    return logprobs, TopK(values, indices)
