"""Turn a list of admitted requests into one forward pass, and its results back into tokens.

Per step the Python work is one pass over the requests to gather ids, lengths and slots; all
per-token work (attention metadata, sampling, logprobs, pooling) is done on tensors for the
whole batch. Pooled requests (prefill only) finish in the step that computes their last prompt
token, with the vector pooled from that step's tensors; the hidden states are only asked of the
model when an embedding request is in the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sluice.aborts import internal_error
from sluice.messages import FinishReason, TopLogprobs
from sluice.model.forward_batch import ForwardBatch, ForwardMode, ForwardOutput
from sluice.model.sampler import SamplingBatchInfo, TopK, sample, token_logprobs
from sluice.scheduler.req import EMBED, SCORE, Req

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler


NON_FINITE = internal_error("the model produced non-finite logits for this request")


def run_prefill(sched: Scheduler, reqs: list[Req]) -> None:
    """Compute `req.extend_len` tokens of each request from `kv_committed_len` on; sample the
    first output token of requests whose whole prompt is now in the pool."""
    r2t = sched.req_pool.req_to_token
    slots = sched.alloc_slots(sum(r.extend_len for r in reqs))
    input_ids: list[int] = []
    logits_rows: list[int] = []  # rows of the flat token batch whose logits are computed
    spans: list[tuple[Req, int, int]] = []  # input logprobs: (req, first logits row, position)
    sample_reqs: list[Req] = []
    sample_rows: list[int] = []  # index into logits_rows of each sampled request's last token
    offset = 0
    for req in reqs:
        start, end = req.kv_committed_len, req.kv_committed_len + req.extend_len
        r2t[req.req_pool_idx, start:end] = slots[offset : offset + req.extend_len]
        input_ids.extend(req.fill_ids[start:end])
        if req.wants_input_logprobs:
            first = max(start, req.logprob_start_len - 1, 0)
            if first < end:
                spans.append((req, len(logits_rows), first))
                logits_rows.extend(range(offset + first - start, offset + end - start))
        if end == req.seq_len and not req.is_chunked:
            last = offset + req.extend_len - 1
            if not logits_rows or logits_rows[-1] != last:
                logits_rows.append(last)
            sample_rows.append(len(logits_rows) - 1)
            sample_reqs.append(req)
        offset += req.extend_len
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, input_ids, [r.kv_committed_len for r in reqs],
        [r.extend_len for r in reqs], slots, r2t, [r.req_pool_idx for r in reqs], logits_rows,
        sched.runner.device,
    )  # fmt: skip
    out = _forward(sched, fb, slots, with_hidden=any(r.pooled == EMBED for r in sample_reqs))
    for req in reqs:
        req.kv_committed_len += req.extend_len
    if spans:
        _input_logprobs(out.logits, spans)
    if sample_reqs:
        hidden = None if out.hidden is None else out.hidden[sample_rows]
        _sample_and_append(sched, sample_reqs, out.logits[sample_rows], hidden)


def run_decode(sched: Scheduler, reqs: list[Req]) -> None:
    r2t = sched.req_pool.req_to_token
    slots = sched.alloc_slots(len(reqs))
    rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    cols = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64)
    r2t[rows, cols] = slots
    fb = ForwardBatch.build(
        ForwardMode.DECODE, [r.output_ids[-1] for r in reqs], cols.tolist(), [1] * len(reqs),
        slots, r2t, rows.tolist(), list(range(len(reqs))), sched.runner.device,
    )  # fmt: skip
    logits = _forward(sched, fb, slots).logits
    for req in reqs:
        req.kv_committed_len += 1
    _sample_and_append(sched, reqs, logits)


def _forward(
    sched: Scheduler, fb: ForwardBatch, slots: torch.Tensor, with_hidden: bool = False
) -> ForwardOutput:
    """Run the model; on failure give this step's slots back (nobody has committed them)."""
    try:
        if with_hidden:
            return sched.runner.forward_output(fb)
        return ForwardOutput(sched.runner.forward(fb), None)
    except Exception:
        sched.allocator.free(slots)
        raise


def _input_logprobs(logits: torch.Tensor, spans: list[tuple[Req, int, int]]) -> None:
    """The logits at position q give the logprob of prompt token q + 1; prompt token 0 has
    none (None when the request starts its logprobs at 0)."""
    for req, first_row, first_pos in spans:
        prompt_len = len(req.origin_input_ids)
        num = min(req.kv_committed_len, prompt_len - 1) - first_pos
        if req.logprob_start_len == 0 and first_pos == 0:
            req.input_token_logprobs.append(None)
            req.input_top_logprobs.append(None)
        if num <= 0:
            continue
        ids = req.origin_input_ids[first_pos + 1 : first_pos + 1 + num]
        targets = torch.tensor(ids, device=logits.device)
        lps, top = token_logprobs(
            logits[first_row : first_row + num], targets, req.top_logprobs_num
        )
        req.input_token_logprobs.extend(lps.tolist())
        req.input_top_logprobs.extend(_top_list(top, num) or [None] * num)


def _sample_and_append(
    sched: Scheduler, reqs: list[Req], logits: torch.Tensor, hidden: torch.Tensor | None = None
) -> None:
    """Sample one token per request. Prompt-only requests (max_new_tokens 0, e.g. echo for
    prompt logprobs) finish without sampling, pooled ones with their vector; a request whose
    logits are not finite (NaN/inf) ends alone with a 500 while the rest of the batch goes on.
    `hidden` [B, hidden] is given when an embedding request is among `reqs`."""
    pooled = [i for i, r in enumerate(reqs) if r.pooled is not None]
    if pooled:
        _finish_pooled(sched, [reqs[i] for i in pooled], logits[pooled], hidden, pooled)
    # a row's sum is finite iff all its logits are (finite logits never add up to inf): one
    # reduction instead of an elementwise test over [B, vocab]
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    keep = []
    for i, req in enumerate(reqs):
        if req.pooled is not None:
            continue
        if req.max_new_tokens == 0:
            sched.touched.append(req)
            sched.finish(req, FinishReason(type="length"))
        elif not finite[i]:
            sched.touched.append(req)
            sched.finish(req, NON_FINITE)
        else:
            keep.append(i)
    if len(keep) < len(reqs):
        reqs, logits = [reqs[i] for i in keep], logits[keep]
        if not reqs:
            return
    grammar_rows = [i for i, r in enumerate(reqs) if r.is_constrained]
    masks = (
        sched.grammars.fill_masks([reqs[i].grammar for i in grammar_rows]) if grammar_rows else None
    )
    info = SamplingBatchInfo.build(
        [r.params for r in reqs], [r.seed for r in reqs],
        [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
        [list(r.stop_ids) if len(r.output_ids) < r.params.min_new_tokens else [] for r in reqs],
        logits.shape[-1], logits.device, grammar_rows, masks,
    )  # fmt: skip
    max_top = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
    want_lp = any(r.return_logprob for r in reqs)
    out = sample(logits, info, max_top, need_logprobs=want_lp)
    tokens = out.next_token_ids.tolist()
    lps = out.logprobs.tolist() if want_lp else None
    tops = _top_list(out.top_logprobs, len(reqs)) if want_lp and max_top else None
    for i, req in enumerate(reqs):
        if req.return_logprob:
            req.output_token_logprobs.append(lps[i])
            if tops is not None and req.top_logprobs_num:
                t = tops[i]
                n = req.top_logprobs_num
                req.output_top_logprobs.append(TopLogprobs(t.token_ids[:n], t.logprobs[:n]))
            else:
                req.output_top_logprobs.append(TopLogprobs([], []))
        sched.on_token(req, tokens[i])


def _finish_pooled(
    sched: Scheduler,
    reqs: list[Req],
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
    rows: list[int],
) -> None:
    """Finish pooled requests: one normalize over the embedding rows, one log_softmax over the
    score rows. logits [P, vocab] are theirs; `rows` index their rows in `hidden` [B, hidden]."""
    embed = [i for i, r in enumerate(reqs) if r.pooled == EMBED]
    score = [i for i, r in enumerate(reqs) if r.pooled == SCORE]
    if embed:
        assert hidden is not None, "an embedding request needs the hidden states"
        vecs = F.normalize(hidden[[rows[i] for i in embed]].float(), dim=-1)  # [E, hidden]
        _store_pooled(sched, [reqs[i] for i in embed], vecs, [vecs.shape[1]] * len(embed))
    if score:
        scored = [reqs[i] for i in score]
        labels = [r.label_token_ids or [] for r in scored]
        width = max(len(x) for x in labels)
        index = torch.tensor([x + [0] * (width - len(x)) for x in labels], dtype=torch.int64)
        lps = torch.log_softmax(logits[score].float(), dim=-1)  # [S, vocab]
        picked = lps.gather(1, index.to(lps.device))  # [S, width], padded with token 0
        _store_pooled(sched, scored, picked, [len(x) for x in labels])


def _store_pooled(sched: Scheduler, reqs: list[Req], vecs: torch.Tensor, lens: list[int]) -> None:
    """Row i of vecs [P, width] holds request i's vector in its first lens[i] columns; a
    non-finite vector ends its request with a 500."""
    pad = (
        torch.arange(vecs.shape[1], device=vecs.device)[None, :]
        >= torch.tensor(lens, device=vecs.device)[:, None]
    )
    finite = (torch.isfinite(vecs) | pad).all(dim=-1).tolist()
    arr = vecs.cpu().numpy().astype("<f4")
    for req, row, n, ok in zip(reqs, arr, lens, finite, strict=True):
        sched.touched.append(req)
        if not ok:
            sched.finish(req, NON_FINITE)
            continue
        req.pooled_result = row[:n].tobytes()
        sched.finish(req, FinishReason(type="length"))


def _top_list(top: TopK | None, n: int) -> list[TopLogprobs] | None:
    if top is None:
        return None
    values, indices = top.values.tolist(), top.indices.tolist()
    return [TopLogprobs(indices[i], values[i]) for i in range(n)]
