"""Turn a list of admitted requests into one forward pass, and its results back into tokens.

Per step the Python work is one pass over the requests to gather ids, lengths and slots; all
per-token work (attention metadata, sampling, logprobs) is done on tensors for the whole batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sluice.messages import FinishReason, TopLogprobs
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.sampler import SamplingBatchInfo, TopK, sample, token_logprobs
from sluice.scheduler.req import Req

if TYPE_CHECKING:
    from sluice.scheduler.scheduler import Scheduler


NON_FINITE = FinishReason(
    type="abort", message="the model produced non-finite logits for this request",
    status_code=500, code="internal_error",
)  # fmt: skip


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
    logits = _forward(sched, fb, slots)
    for req in reqs:
        req.kv_committed_len += req.extend_len
    if spans:
        _input_logprobs(logits, spans)
    if sample_reqs:
        _sample_and_append(sched, sample_reqs, logits[sample_rows])


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
    logits = _forward(sched, fb, slots)
    for req in reqs:
        req.kv_committed_len += 1
    _sample_and_append(sched, reqs, logits)


def _forward(sched: Scheduler, fb: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
    """Run the model; on failure give this step's slots back (nobody has committed them)."""
    try:
        return sched.runner.forward(fb)
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
        targets = torch.tensor(req.origin_input_ids[first_pos + 1 : first_pos + 1 + num])
        lps, top = token_logprobs(
            logits[first_row : first_row + num], targets, req.top_logprobs_num
        )
        req.input_token_logprobs.extend(lps.tolist())
        req.input_top_logprobs.extend(_top_list(top, num) or [None] * num)


def _sample_and_append(sched: Scheduler, reqs: list[Req], logits: torch.Tensor) -> None:
    """Sample one token per request. Prompt-only requests (max_new_tokens 0, e.g. echo for
    prompt logprobs) finish without sampling; a request whose logits are not finite (NaN/inf)
    ends alone with a 500 while the rest of the batch goes on."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    keep = []
    for i, req in enumerate(reqs):
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
    info = SamplingBatchInfo.build(
        [r.params for r in reqs], [r.seed for r in reqs],
        [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
        [list(r.stop_ids) if len(r.output_ids) < r.params.min_new_tokens else [] for r in reqs],
        logits.shape[-1], logits.device,
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


def _top_list(top: TopK | None, n: int) -> list[TopLogprobs] | None:
    if top is None:
        return None
    values, indices = top.values.tolist(), top.indices.tolist()
    return [TopLogprobs(indices[i], values[i]) for i in range(n)]
