"""One scheduler step as data: a plan in (`StepPlan`), the model's result out (`StepOutput`).

- `plan_prefill` / `plan_decode` (scheduler side, no model): the requests of the step, the new
  KV slots written into their `req_to_token` rows, the `ForwardBatch`, which logits rows are
  computed, and which requests reach a token to sample (`last`) or prompt logprobs to give.
- `execute(runner, plan)` (model side, no scheduler): one forward, then on tensors for the whole
  batch: the finite check, sampling with the plan's grammar masks, logprobs, pooled vectors;
  it returns plain lists and changes no request.
- The scheduler applies the output to its requests (`Scheduler._apply_step`).

Per step the Python work is one pass over the requests to gather ids, lengths and slots; all
per-token work is done on tensors for the whole batch. Pooled requests (prefill only) finish in
the step that computes their last prompt token, with the vector pooled from that step's tensors;
the hidden states are only asked of the model when an embedding request is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sluice.aborts import internal_error
from sluice.messages import FinishReason, TopLogprobs
from sluice.model.forward_batch import ForwardBatch, ForwardMode, ForwardOutput
from sluice.model.runner import ModelRunner
from sluice.model.sampler import (
    KERNEL_DTYPES,
    SampleOutput,
    SamplingBatchInfo,
    TopK,
    is_plain_greedy,
    masked_argmax,
    sample,
    token_logprobs,
)
from sluice.scheduler.req import EMBED, SCORE, Req

NON_FINITE = internal_error("the model produced non-finite logits for this request")


@dataclass
class StepPlan:
    """What one forward computes. `last[i]` has its logits at row `last_rows[i]`: its prompt is
    complete after this step (prefill) or it decodes; `spans` are the prompt-logprob ranges
    (req, first logits row, first position). Of the requests of `last` that a grammar
    constrains now (`Scheduler._plan_grammar`), those of `checked` take their greedy token when
    their grammar allows it and only otherwise get a mask (`fill_masks`, after the forward);
    the others (`masked`) have their masks `grammar_masks` [G, ceil(V / 32)], in order, filled
    while the forward runs, so sampling waits for them."""

    reqs: list[Req]
    forward: ForwardBatch
    new_lens: list[int]  # tokens each request of `reqs` computes
    last: list[Req]
    last_rows: list[int]
    spans: list[tuple[Req, int, int]] = field(default_factory=list)
    masked: list[Req] = field(default_factory=list)
    grammar_masks: Future[torch.Tensor] | None = None
    checked: list[Req] = field(default_factory=list)
    fill_masks: Callable[[list[Req]], torch.Tensor] | None = None


@dataclass
class StepOutput:
    """Per request of the plan's `last`: its sampled token (None: not sampled), its error (the
    logits were not finite), its logprobs and pooled vector; per span, the prompt logprobs."""

    tokens: list[int | None]
    errors: list[FinishReason | None]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]
    pooled: list[bytes | None]
    input_logprobs: list[tuple[Req, list[float | None], list[TopLogprobs | None]]]


def plan_prefill(
    reqs: list[Req], req_to_token: torch.Tensor, slots: torch.Tensor, device
) -> StepPlan:
    """Compute `req.extend_len` tokens of each request from `kv_committed_len` on."""
    input_ids: list[int] = []
    logits_rows: list[int] = []  # rows of the flat token batch whose logits are computed
    spans: list[tuple[Req, int, int]] = []
    last: list[Req] = []
    last_rows: list[int] = []  # index into logits_rows of each request's last token
    offset = 0
    for req in reqs:
        start, end = req.kv_committed_len, req.kv_committed_len + req.extend_len
        req_to_token[req.req_pool_idx, start:end] = slots[offset : offset + req.extend_len]
        input_ids.extend(req.fill_ids[start:end])
        if req.wants_input_logprobs:
            first = max(start, req.logprob_start_len - 1, 0)
            if first < end:
                spans.append((req, len(logits_rows), first))
                logits_rows.extend(range(offset + first - start, offset + end - start))
        if end == req.seq_len and not req.is_chunked:
            row = offset + req.extend_len - 1
            if not logits_rows or logits_rows[-1] != row:
                logits_rows.append(row)
            last_rows.append(len(logits_rows) - 1)
            last.append(req)
        offset += req.extend_len
    new_lens = [r.extend_len for r in reqs]
    # every request's images (the forward takes the rows of its new positions); none for text
    images = [r.images for r in reqs] if any(r.images for r in reqs) else None
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, input_ids, [r.kv_committed_len for r in reqs], new_lens, slots,
        req_to_token, [r.req_pool_idx for r in reqs], logits_rows, device, images,
    )  # fmt: skip
    return StepPlan(reqs, fb, new_lens, last, last_rows, spans)


def plan_decode(
    reqs: list[Req], req_to_token: torch.Tensor, slots: torch.Tensor, device: torch.device
) -> StepPlan:
    fb = ForwardBatch.decode(
        [r.output_ids[-1] for r in reqs], [r.kv_committed_len for r in reqs],
        [r.req_pool_idx for r in reqs], slots, req_to_token.numpy(),
    ).to(device)  # fmt: skip
    return StepPlan(reqs, fb, [1] * len(reqs), list(reqs), list(range(len(reqs))))


def execute(runner: ModelRunner, plan: StepPlan) -> StepOutput:
    """Run the plan's forward and turn its logits into tokens, logprobs and vectors."""
    with_hidden = any(r.pooled == EMBED for r in plan.last)
    if with_hidden:
        out = runner.forward_output(plan.forward)
    else:
        if runner.cpu_ops is not None and _argmax_only(plan):
            return _argmax_step(
                plan, runner.forward(plan.forward, float_logits=False), runner.cpu_ops
            )
        out = ForwardOutput(runner.forward(plan.forward), None)
    input_lps = _input_logprobs(out.logits, plan.spans, plan.reqs, plan.new_lens)
    n = len(plan.last)
    result = StepOutput([None] * n, [None] * n, [None] * n, [None] * n, [None] * n, input_lps)
    if not plan.last:
        return result
    logits = _rows(out.logits, plan.last_rows)  # [L, vocab]
    hidden = None if out.hidden is None else _rows(out.hidden, plan.last_rows)
    finite = _finite_rows(logits, runner.cpu_ops)
    pooled = [i for i, r in enumerate(plan.last) if r.pooled is not None]
    if pooled:
        _pool(plan.last, pooled, logits, hidden, result)
    sampled = sampled_rows(plan)
    for i in sampled:
        if not finite[i]:
            result.errors[i] = NON_FINITE
    if any(finite[i] for i in sampled):
        _sample(plan, [i for i in sampled if finite[i]], logits, result, runner.cpu_ops)
    return result


def _argmax_only(plan: StepPlan) -> bool:
    """Whether the step's logits serve only each row's argmax: no prompt logprobs, and every
    request of plan.last is a plain greedy generation (no logit processor, stop blocking or
    grammar) that wants no logprobs."""
    return not plan.spans and all(
        r.pooled is None and not r.return_logprob and not r.is_constrained
        and is_plain_greedy(r.params) and not _blocks_stops(r)
        for r in plan.last
    )  # fmt: skip


def _argmax_step(plan: StepPlan, logits: torch.Tensor, kernels: Any) -> StepOutput:
    """`execute`'s result for an `_argmax_only` step, from its logits in the model's dtype
    (float32 or bfloat16: widening to float32 is exact, so the same tokens as `_sample`'s
    argmax of the float32 logits, without that copy of [rows, vocab]): one pass of the CPU
    kernels over them, the finite test and the argmax together (`greedy_rows`)."""
    n = len(plan.last)
    result = StepOutput([None] * n, [None] * n, [None] * n, [None] * n, [None] * n, [])
    if not plan.last:
        return result
    logits = _rows(logits, plan.last_rows)
    if logits.dtype not in KERNEL_DTYPES:
        logits = logits.float()
    tokens = kernels.greedy_rows(
        logits if logits.stride(-1) == 1 else logits.contiguous()
    ).tolist()  # -1: a row with an infinity or NaN
    for i in sampled_rows(plan):
        if tokens[i] >= 0:
            result.tokens[i] = tokens[i]
        else:
            result.errors[i] = NON_FINITE
    return result


def _finite_rows(logits: torch.Tensor, kernels: Any | None) -> list[bool]:
    """Per row of logits [L, vocab] (float32; bfloat16 with the kernels): whether all of it is finite. sluice's kernel on the
    CPU; else a row's sum (finite logits do not add up to inf at logit scale): one reduction,
    not an elementwise test over [L, vocab]."""
    if kernels is not None and logits.device.type == "cpu" and logits.dtype in KERNEL_DTYPES:
        return kernels.finite_rows(logits if logits.stride(-1) == 1 else logits.contiguous())
    return torch.isfinite(logits.sum(dim=-1)).tolist()


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for increasing `rows` (as `last_rows` are): x itself when they are all of its rows
    (a decode step), with no copy of a [rows, vocab] tensor."""
    return x if len(rows) == x.shape[0] else x[rows]


def sampled_rows(plan: StepPlan) -> list[int]:
    """The requests of plan.last (by index) that sample a token: generation requests with
    tokens to go (a prompt-only or pooled request finishes without one)."""
    return [i for i, r in enumerate(plan.last) if r.pooled is None and r.max_new_tokens > 0]


def constrained_reqs(plan: StepPlan) -> list[Req]:
    """The sampling requests that a grammar constrains in this step, in order."""
    return [plan.last[i] for i in sampled_rows(plan) if plan.last[i].is_constrained]


def checks_first(req: Req) -> bool:
    """A constrained request whose mask is filled only if its grammar refuses its greedy token:
    greedy with no logit processor (no penalties, logit_bias, stops blocked below
    min_new_tokens), no optional reasoning to open, and no bytes forced next (there the mask
    is narrower than the grammar, see `GrammarMatcher.allows`). Its token is the argmax of its
    raw logits when the grammar allows that token, which is then also the argmax of the allowed
    ones (the first index of their maximum): the token a mask would give."""
    return (
        req.reasoning_start_id < 0 and is_plain_greedy(req.params) and not _blocks_stops(req)
        and not req.grammar.has_forced_bytes
    )  # fmt: skip


def _input_logprobs(
    logits: torch.Tensor, spans: list[tuple[Req, int, int]], reqs: list[Req], new_lens: list[int]
) -> list[tuple[Req, list[float | None], list[TopLogprobs | None]]]:
    """The logits at position q give the logprob of prompt token q + 1; prompt token 0 has
    none (None when the request starts its logprobs at 0)."""
    if not spans:
        return []
    out = []
    committed = {id(r): r.kv_committed_len + n for r, n in zip(reqs, new_lens, strict=True)}
    for req, first_row, first_pos in spans:
        lps: list[float | None] = []
        tops: list[TopLogprobs | None] = []
        prompt_len = len(req.origin_input_ids)
        num = min(committed[id(req)], prompt_len - 1) - first_pos
        if req.logprob_start_len == 0 and first_pos == 0:
            lps.append(None)
            tops.append(None)
        if num > 0:
            ids = req.origin_input_ids[first_pos + 1 : first_pos + 1 + num]
            # an image position's id lies outside the vocabulary: it has no logprob (None)
            vocab = logits.shape[-1]
            targets = torch.tensor(ids, device=logits.device).clamp(0, vocab - 1)
            values, top = token_logprobs(
                logits[first_row : first_row + num], targets, req.top_logprobs_num
            )
            lps.extend(v if t < vocab else None for t, v in zip(ids, values.tolist(), strict=True))
            tops.extend(_top_list(top, num) or [None] * num)
        out.append((req, lps, tops))
    return out


def _sample(
    plan: StepPlan, rows: list[int], logits: torch.Tensor, result: StepOutput, kernels: Any | None
) -> None:
    """Sample one token for each of the `rows` of plan.last (generation requests with finite
    logits); the requests of plan.masked get their mask (plan.grammar_masks, in their order),
    those of plan.checked one only if their grammar refuses their greedy token; masks are
    applied by `kernels` (the runner's CPU kernels) when not None."""
    reqs = [plan.last[i] for i in rows]
    order = {id(r): k for k, r in enumerate(plan.masked)}
    grammar_rows = [j for j, r in enumerate(reqs) if id(r) in order]
    masks = None
    if grammar_rows:
        masks = plan.grammar_masks.result()[[order[id(reqs[j])] for j in grammar_rows]]
    info = SamplingBatchInfo.build(
        [r.params for r in reqs], [r.seed for r in reqs],
        [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
        [list(r.stop_ids) if _blocks_stops(r) else [] for r in reqs],
        logits.shape[-1], logits.device, grammar_rows, masks,
    )  # fmt: skip
    max_top = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
    want_lp = any(r.return_logprob for r in reqs)
    picked = logits[rows] if len(rows) < len(plan.last) else logits
    out = sample(picked, info, max_top, want_lp, kernels)
    tokens = out.next_token_ids.tolist()
    if plan.checked:
        _check_grammars(plan, reqs, picked, tokens, out, kernels)
    lps = out.logprobs.tolist() if want_lp else None
    tops = _top_list(out.top_logprobs, len(reqs)) if want_lp and max_top else None
    for j, (i, req) in enumerate(zip(rows, reqs, strict=True)):
        result.tokens[i] = tokens[j]
        if req.return_logprob:
            result.logprobs[i] = lps[j]
            k = req.top_logprobs_num
            top = tops[j] if tops is not None and k else None
            result.top_logprobs[i] = (
                TopLogprobs(top.token_ids[:k], top.logprobs[:k]) if top else TopLogprobs([], [])
            )


def _check_grammars(
    plan: StepPlan,
    reqs: list[Req],
    logits: torch.Tensor,
    tokens: list[int],
    out: SampleOutput,
    kernels: Any | None,
) -> None:
    """The checked requests' greedy tokens (`tokens`, by row of `reqs` and `logits`) that their
    grammar refuses are replaced, in place, by the argmax of the logits it allows, with their
    masks filled now; so are their logprobs in `out` (always those of the raw logits)."""
    checked = {id(r) for r in plan.checked}
    refused = [
        j for j, r in enumerate(reqs) if id(r) in checked and not r.grammar.allows(tokens[j])
    ]
    if not refused:
        return
    rows = torch.tensor(refused, dtype=torch.int64, device=logits.device)
    masks = plan.fill_masks([reqs[j] for j in refused])
    fixed = masked_argmax(logits, masks, rows, kernels)
    for j, token in zip(refused, fixed.tolist(), strict=True):
        tokens[j] = token
    out.next_token_ids[rows] = fixed
    if out.logprobs is not None:
        out.logprobs[rows] = token_logprobs(logits[rows], fixed)[0]


def _pool(
    last: list[Req],
    rows: list[int],
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
    result: StepOutput,
) -> None:
    """Vectors of pooled requests: one normalize over the embedding rows, one log_softmax over
    the score rows; a non-finite vector is an error (a 500)."""
    embed = [i for i in rows if last[i].pooled == EMBED]
    score = [i for i in rows if last[i].pooled == SCORE]
    if embed:
        assert hidden is not None, "an embedding request needs the hidden states"
        vecs = F.normalize(hidden[embed].float(), dim=-1)  # [E, hidden]
        _store_pooled(embed, vecs, [vecs.shape[1]] * len(embed), result)
    if score:
        labels = [last[i].label_token_ids or [] for i in score]
        width = max(len(x) for x in labels)
        index = torch.tensor([x + [0] * (width - len(x)) for x in labels], dtype=torch.int64)
        lps = torch.log_softmax(logits[score].float(), dim=-1)  # [S, vocab]
        picked = lps.gather(1, index.to(lps.device))  # [S, width], padded with token 0
        _store_pooled(score, picked, [len(x) for x in labels], result)


def _store_pooled(rows: list[int], vecs: torch.Tensor, lens: list[int], result: StepOutput) -> None:
    """Row j of vecs [P, width] holds the vector of request rows[j] in its first lens[j]
    columns."""
    pad = (
        torch.arange(vecs.shape[1], device=vecs.device)[None, :]
        >= torch.tensor(lens, device=vecs.device)[:, None]
    )
    finite = (torch.isfinite(vecs) | pad).all(dim=-1).tolist()
    arr = vecs.cpu().numpy().astype("<f4")
    for i, vec, n, ok in zip(rows, arr, lens, finite, strict=True):
        if ok:
            result.pooled[i] = vec[:n].tobytes()
        else:
            result.errors[i] = NON_FINITE


def _top_list(top: TopK | None, n: int) -> list[TopLogprobs] | None:
    if top is None:
        return None
    values, indices = top.values.tolist(), top.indices.tolist()
    return [TopLogprobs(indices[i], values[i]) for i in range(n)]


def _blocks_stops(req: Req) -> bool:
    """The request may not stop yet: below min_new_tokens, or reasoning before its grammar."""
    return len(req.output_ids) < req.params.min_new_tokens or req.is_reasoning_first
