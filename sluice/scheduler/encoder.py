"""EncoderScheduler: the scheduler of an encoder model (embeddings, cross-encoder scores).

Every request is prefill-only and finishes in the step that runs it, so there is no running
batch and no KV cache: a waiting queue, and one forward per step over as many waiting requests
(first come, first served) as fit the token budget, counted as the padded batch the model runs
(requests × longest input). A request alone is always admitted, whatever its length. A request
that waits longer than --waiting-timeout or --running-timeout (the shorter) ends with the same
503 `timeout` finish as a generation request.

Ownership: a request is in `waiting` from intake until the step that runs it or its abort; its
result (or its abort) goes into `outputs`, emitted by the next `step()` as one
BatchEmbeddingOutput. At idle, nothing is waiting and nothing is held.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

import torch

from sluice.aborts import aborted, internal_error, invalid
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    FinishReason,
    InternalState,
    TokenizedEmbeddingReqInput,
)
from sluice.scheduler.timeouts import RUNNING, WAITING, timeout_reason

logger = logging.getLogger(__name__)


class Encoder(Protocol):
    def forward(
        self, seqs: list[list[int]], token_types: list[list[int] | None] | None = None
    ) -> torch.Tensor: ...


class EncoderScheduler:
    def __init__(
        self,
        runner: Encoder,
        vocab_size: int,
        context_len: int,
        max_batch_tokens: int,
        max_batch_reqs: int,
        waiting_timeout: float = 0.0,
        running_timeout: float = 0.0,
    ) -> None:
        self.runner = runner
        self.vocab_size, self.context_len = vocab_size, context_len
        self.max_batch_tokens, self.max_batch_reqs = max_batch_tokens, max_batch_reqs
        self.timeout = _queue_timeout(waiting_timeout, running_timeout)  # (kind, limit) | None
        self.waiting: deque[TokenizedEmbeddingReqInput] = deque()
        self.waiting_rids: set[str] = set()  # the rids in `waiting`
        self.arrivals: deque[float] = deque()  # parallel to `waiting`: monotonic intake times
        self.to_abort: set[str] = set()  # rids marked by AbortReq, ended at the next step
        self.abort_all = False
        self.outputs: list[tuple[TokenizedEmbeddingReqInput, bytes, FinishReason]] = []
        self.last_heartbeat = time.monotonic()
        self.num_forward_steps = 0
        self.num_timeouts = 0
        self.paused = False  # set_paused: no batch runs while set

    # ---- intake -------------------------------------------------------------------------

    def add_request(self, msg: TokenizedEmbeddingReqInput) -> None:
        error = self._validate(msg)
        if error is not None:
            self._finish(msg, b"", invalid(error))
            return
        self.waiting.append(msg)
        self.waiting_rids.add(msg.rid)
        self.arrivals.append(time.monotonic())

    def _validate(self, msg: TokenizedEmbeddingReqInput) -> str | None:
        ids = msg.input_ids
        if msg.label_token_ids is not None:
            return "this model is an encoder: label-token scoring needs a decoder model"
        if not ids:
            return "the input is empty"
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            return f"token ids must be in [0, {self.vocab_size})"
        if len(ids) > self.context_len:
            return f"the input has {len(ids)} tokens; this model takes at most {self.context_len}"
        if msg.token_type_ids is not None and len(msg.token_type_ids) != len(ids):
            return "token_type_ids and input_ids differ in length"
        if msg.rid in self.waiting_rids:
            return f"a request with rid {msg.rid!r} is already waiting"
        return None

    def abort(self, msg: AbortReq) -> None:
        """End waiting requests with an abort: all of them now for abort_all; a rid at the start
        of the next step (a call of many inputs that ends early sends one AbortReq per input:
        the queue is filtered once for all of them). A request already run has nothing to abort."""
        if msg.abort_all:  # now: it is about what is waiting now, not what comes next
            self.abort_all = True
            self._process_aborts()
        else:
            self.to_abort.add(msg.rid)

    def _process_aborts(self) -> None:
        if not (self.abort_all or self.to_abort):
            return
        reason = aborted()
        keep: deque[TokenizedEmbeddingReqInput] = deque()
        keep_arrivals: deque[float] = deque()
        for req, arrival in zip(self.waiting, self.arrivals, strict=True):
            if self.abort_all or req.rid in self.to_abort:
                self._finish(req, b"", reason)
            else:
                keep.append(req)
                keep_arrivals.append(arrival)
        self.waiting, self.arrivals = keep, keep_arrivals
        self.waiting_rids = {r.rid for r in keep}
        self.abort_all, self.to_abort = False, set()

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> BatchEmbeddingOutput | None:
        self.last_heartbeat = now = time.monotonic()
        self._process_aborts()
        self._expire(now)
        batch = [] if self.paused else self._take_batch()
        if batch:
            self._run(batch)
        return self._take_outputs()

    def has_work(self) -> bool:
        return bool(self.waiting or self.outputs or self.to_abort or self.abort_all)

    def set_paused(self, paused: bool) -> None:
        """Paused, `step()` still ends aborted and expired requests but runs no batch."""
        self.paused = paused

    def is_idle(self) -> bool:
        return not self.waiting

    def _take_batch(self) -> list[TokenizedEmbeddingReqInput]:
        batch: list[TokenizedEmbeddingReqInput] = []
        longest = 0
        while self.waiting and len(batch) < self.max_batch_reqs:
            longest_with = max(longest, len(self.waiting[0].input_ids))
            if batch and longest_with * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append(self.waiting.popleft())
            self.waiting_rids.discard(batch[-1].rid)
            self.arrivals.popleft()
            longest = longest_with
        return batch

    def _expire(self, now: float) -> None:
        """End the requests that waited past the timeout (the oldest are first in line). A
        request runs in one forward, so waiting is all of its life that a timeout can cut."""
        if self.timeout is None:
            return
        kind, limit = self.timeout
        while self.arrivals and now - self.arrivals[0] > limit:
            self.arrivals.popleft()
            req = self.waiting.popleft()
            self.waiting_rids.discard(req.rid)
            self._finish(req, b"", timeout_reason(kind, limit))
            self.num_timeouts += 1

    def _run(self, batch: list[TokenizedEmbeddingReqInput]) -> None:
        """One forward; a failing forward ends the batch's requests with a 500, not the process."""
        try:
            out = self.runner.forward(
                [r.input_ids for r in batch], [r.token_type_ids for r in batch]
            )  # [B, dim]
        except Exception as exc:
            logger.exception("forward failed; aborting the %d requests of the batch", len(batch))
            reason = internal_error(f"internal error: {type(exc).__name__}: {exc}")
            for req in batch:
                self._finish(req, b"", reason)
            return
        self.num_forward_steps += 1
        rows = out.to(torch.float32).cpu().numpy().astype("<f4")
        done = FinishReason(type="length")
        for req, row in zip(batch, rows, strict=True):
            self._finish(req, row.tobytes(), done)

    def _finish(self, req: TokenizedEmbeddingReqInput, vector: bytes, reason: FinishReason) -> None:
        self.outputs.append((req, vector, reason))

    def _take_outputs(self) -> BatchEmbeddingOutput | None:
        if not self.outputs:
            return None
        outputs, self.outputs = self.outputs, []
        return BatchEmbeddingOutput(
            rids=[r.rid for r, _, _ in outputs],
            embeddings=[v for _, v, _ in outputs],
            prompt_tokens=[len(r.input_ids) for r, _, _ in outputs],
            finished_reasons=[f for _, _, f in outputs],
            reply_to=[r.reply_to for r, _, _ in outputs],
        )

    # ---- introspection --------------------------------------------------------------------

    def internal_state(self) -> InternalState:
        return InternalState(
            num_running_reqs=0, num_waiting_reqs=len(self.waiting), kv_total=0, kv_free=0,
            kv_cached=0, kv_in_use=0, last_heartbeat=self.last_heartbeat,
            device=str(getattr(self.runner, "device", "")),
            dtype=str(getattr(self.runner, "dtype", "")).removeprefix("torch."),
            paused=self.paused,
        )  # fmt: skip

    def flush_cache(self) -> bool:
        return True  # nothing is cached


def _queue_timeout(waiting: float, running: float) -> tuple[str, float] | None:
    """The timeout that applies to a queued encoder request: the shorter of the two set."""
    set_ = [(limit, kind) for kind, limit in ((WAITING, waiting), (RUNNING, running)) if limit > 0]
    if not set_:
        return None
    limit, kind = min(set_)
    return kind, limit
