"""Collect what the touched requests have to report into one BatchTokenIDOutput, and what the
finished pooled requests have into one BatchEmbeddingOutput.

A request reports when it finished, or when it streams and has at least `stream_interval` unsent
tokens. Its unsent tokens and logprobs are moved into the message, so nothing is sent twice and
nothing is dropped. A pooled request reports once, when it finished.
"""

from __future__ import annotations

from sluice.messages import BatchEmbeddingOutput, BatchTokenIDOutput
from sluice.scheduler.req import Req


def build_output(touched: list[Req], stream_interval: int) -> BatchTokenIDOutput | None:
    out = BatchTokenIDOutput(
        rids=[], new_token_ids=[], finished_reasons=[], prompt_tokens=[], completion_tokens=[],
        cached_tokens=[], skip_special_tokens=[], spaces_between_special_tokens=[],
        stop_strings=[], no_stop_trim=[], output_token_logprobs=[], output_top_logprobs=[],
        input_token_logprobs=[], input_top_logprobs=[], reply_to=[],
    )  # fmt: skip
    seen: set[int] = set()
    for req in touched:
        if id(req) in seen:
            continue
        seen.add(id(req))
        unsent = len(req.output_ids) - req.sent_len
        if not req.is_finished and not (req.stream and unsent >= stream_interval):
            continue
        _append(out, req)
    return out if out.rids else None


def _append(out: BatchTokenIDOutput, req: Req) -> None:
    p = req.params
    out.rids.append(req.rid)
    out.new_token_ids.append(req.output_ids[req.sent_len :])
    req.sent_len = len(req.output_ids)
    out.finished_reasons.append(req.finished_reason)
    out.prompt_tokens.append(len(req.origin_input_ids))
    out.completion_tokens.append(len(req.output_ids))
    out.cached_tokens.append(req.cached_tokens)
    out.skip_special_tokens.append(p.skip_special_tokens)
    out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
    out.stop_strings.append(p.stop)
    out.no_stop_trim.append(p.no_stop_trim)
    out.output_token_logprobs.append(req.output_token_logprobs)
    out.output_top_logprobs.append(req.output_top_logprobs)
    req.output_token_logprobs, req.output_top_logprobs = [], []
    out.input_token_logprobs.append(req.input_token_logprobs)
    out.input_top_logprobs.append(req.input_top_logprobs)
    req.input_token_logprobs, req.input_top_logprobs = [], []
    out.reply_to.append(req.reply_to)


def build_embedding_output(done: list[Req]) -> BatchEmbeddingOutput | None:
    """One entry per finished pooled request (each once, even if listed twice)."""
    out = BatchEmbeddingOutput(
        rids=[], embeddings=[], prompt_tokens=[], finished_reasons=[], reply_to=[],
        cached_tokens=[],
    )  # fmt: skip
    seen: set[int] = set()
    for req in done:
        if id(req) in seen:
            continue
        seen.add(id(req))
        assert req.finished_reason is not None, "a pooled request reports only when finished"
        out.rids.append(req.rid)
        out.embeddings.append(req.pooled_result)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.finished_reasons.append(req.finished_reason)
        out.reply_to.append(req.reply_to)
        out.cached_tokens.append(req.cached_tokens)
    return out if out.rids else None
