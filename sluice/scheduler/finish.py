"""Finish checks run after each sampled token: stop ids, length, stop strings."""

from __future__ import annotations

from typing import Any

from sluice.messages import FinishReason
from sluice.scheduler.req import Req


class FinishChecker:
    """Decides whether a request is done after appending a token.

    Stop strings are matched on the decoded tail of the output only, so a stop string in the
    prompt never ends a request; the detokenizer trims the matched string from the text.
    """

    def __init__(self, tokenizer: Any, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len

    def check(self, req: Req) -> FinishReason | None:
        num_out = len(req.output_ids)
        last = req.output_ids[-1]
        if last in req.stop_ids and num_out > req.params.min_new_tokens:
            return FinishReason(type="stop", matched=last)
        if num_out >= req.max_new_tokens or req.seq_len >= self.context_len:
            return FinishReason(type="length", matched=None)
        if req.params.stop and num_out > req.params.min_new_tokens:
            matched = self._match_stop_string(req)
            if matched is not None:
                return FinishReason(type="stop", matched=matched)
        return None

    def _match_stop_string(self, req: Req) -> str | None:
        stops = req.params.stop
        # a token decodes to at least one character or part of one: this tail always covers
        # the longest stop string plus the token that completed it
        tail_len = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(
            req.output_ids[-tail_len:], skip_special_tokens=req.params.skip_special_tokens
        )
        for s in stops:
            if s and s in tail:
                return s
        return None
