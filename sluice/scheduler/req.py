"""Req: one generation request as the scheduler sees it, from intake to finish.

Token bookkeeping (all lengths count tokens of `fill_ids = origin_input_ids + output_ids`):
  - `kv_committed_len`: positions [0, kv_committed_len) have KV in the pool, at
    `req_to_token[req_pool_idx, :kv_committed_len]`;
  - `cache_protected_len`: the leading part of that owned by the radix cache (locked through
    `last_node`); the rest of the committed slots belong to this request alone;
  - during a prefill step, `extend_len` tokens from `kv_committed_len` on are computed.
The last output token never has KV yet: decode computes it as the next step's input.

A pooled request (`pooled` is EMBED or SCORE) is prefill only: max_new_tokens 0, it never
decodes; the step that computes its last prompt token finishes it with `pooled_result`, the
float32 bytes of its embedding or of its label-token logprobs.

A request with images (`images`, sluice.model.multimodal.ImageSpan) has ids outside the
vocabulary exactly at its image positions; the spans stay with it through retraction and
re-admission, and each prefill forward takes the rows of the positions it computes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sluice.messages import FinishReason, SamplingParams, TopLogprobs
from sluice.model.multimodal import ImageSpan
from sluice.scheduler.grammar import GrammarMatcher

EMBED, SCORE = "embed", "score"  # pooling of a prefill-only request


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        seed: int,
        stop_ids: frozenset[int],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        reply_to: str = "",
        timeout: float = 0.0,
        pooled: str | None = None,
        label_token_ids: list[int] | None = None,
        grammar_after_id: int = -1,
        reasoning_start_id: int = -1,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.params = params
        self.max_new_tokens: int = params.max_new_tokens or 0
        self.seed = seed
        # ids that end the request (EOS unless ignore_eos, plus stop_token_ids)
        self.stop_ids = stop_ids
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.stream = stream
        self.reply_to = reply_to
        self.timeout = timeout
        # the session this request is a turn of (set by the scheduler), None otherwise
        self.session_id: str | None = None
        # None: a generation request; EMBED or SCORE (with its label ids): prefill only
        self.pooled = pooled
        self.label_token_ids = label_token_ids
        self.pooled_result = b""  # little-endian float32, set when a pooled request succeeds
        # the grammar state of a constrained request (scheduler/grammar.py), None otherwise;
        # it constrains nothing until `grammar_after_id` was generated (-1: from the start)
        self.grammar: GrammarMatcher | None = None
        self.grammar_after_id = grammar_after_id
        self.reasoning_start_id = reasoning_start_id  # -1 once the first token is out
        # a session turn (sessions.TurnPlan) that starts once this request's grammar compiled
        self.pending_turn: Any = None
        self.images: list[ImageSpan] = []  # in order of offset; set at intake

        self.output_ids: list[int] = []
        self.finished_reason: FinishReason | None = None
        self.to_abort: FinishReason | None = None

        # memory (see module docstring)
        self.req_pool_idx: int | None = None
        self.kv_committed_len = 0
        self.cache_protected_len = 0
        self.last_node = None
        self.extend_len = 0
        self.is_chunked = False
        self.cached_tokens = 0
        self.num_retractions = 0

        # streaming cursors and logprob buffers not yet sent
        self.sent_len = 0
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []
        self.input_token_logprobs: list[float | None] = []
        self.input_top_logprobs: list[TopLogprobs | None] = []

        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_constrained(self) -> bool:
        """The next token is masked by the grammar: no reasoning precedes it, or the reasoning
        is optional and this is the first token (then its opening token is allowed too)."""
        return self.grammar is not None and (
            self.grammar_after_id < 0 or self.reasoning_start_id >= 0
        )

    @property
    def is_reasoning_first(self) -> bool:
        """A grammar waits for the end of the reasoning: the stop tokens are blocked."""
        return self.grammar is not None and self.grammar_after_id >= 0 and not self.is_constrained

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.output_ids

    def prefix_match_limit(self) -> int:
        """How many leading tokens may come from the cache. At least one token is always
        computed (its logits pick the next token); input logprobs need logits from the start."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def committed_kv(self, req_to_token: torch.Tensor) -> torch.Tensor:
        assert self.req_pool_idx is not None
        return req_to_token[self.req_pool_idx, : self.kv_committed_len].clone()

    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.cache_protected_len = 0
        self.last_node = None
        self.extend_len = 0
        self.is_chunked = False
        self.num_retractions += 1

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
        )
