"""ReqState: what the HTTP process knows of one live rid, and how updates fold into it; Updates:
how the consumer of one generate_request call learns of them.

The dicts handed to `generate_request`'s consumer are built here (`output_dict`); their format
is the TokenizerManager's contract with the HTTP layer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sluice.messages import BatchStrOutput, FinishReason

_FINISH_FIELDS = FinishReason.__struct_fields__
# a keep-alive timer that fires this close to its deadline counts as on time (uvloop's timers
# are in whole milliseconds)
_TIMER_SLACK_S = 0.002


class Updates:
    """The news of one generate_request call for its one consumer: the states that have some,
    in the order they got it (each at most once: `ReqState.queued`); with `tick`, the consumer
    also gets None whenever it waited `tick` seconds with no news (a stream's keep-alive).

    Per update this costs an append and, when the consumer is waiting, one future: no task and
    no wait_for per token. The keep-alive is one timer handle, left armed while news comes: when
    it fires before the current wait's deadline (the deadline moved on since it was armed) it
    re-arms itself for that deadline, so a busy stream sees one timer event per `tick`.
    """

    def __init__(self, tick: float | None = None) -> None:
        self.tick = tick
        self._ready: deque[ReqState] = deque()
        self._waiter: asyncio.Future[bool] | None = None  # the consumer's, while it waits
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # loop time at which the waiting consumer gets a tick

    def put(self, state: ReqState) -> None:
        self._ready.append(state)
        self._wake()

    async def get(self) -> ReqState | None:
        """The next state with news; None when `tick` seconds passed without any."""
        if self._ready:
            return self._ready.popleft()
        loop = asyncio.get_running_loop()
        self._arm(loop)
        while True:
            ticked = await self._sleep(loop)
            if self._ready:
                return self._ready.popleft()
            if ticked:
                return None

    async def wait_done(self, fut: asyncio.Future) -> bool:
        """Whether `fut` is done, once it is or `tick` seconds passed (not done: False)."""
        if fut.done():
            return True
        loop = asyncio.get_running_loop()
        self._arm(loop)
        fut.add_done_callback(self._wake)
        try:
            while not fut.done():
                if await self._sleep(loop):
                    return fut.done()
            return True
        finally:
            fut.remove_done_callback(self._wake)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.tick is None:
            return
        self._deadline = loop.time() + self.tick
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._on_timer, loop)

    async def _sleep(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Until woken (True: by the keep-alive deadline)."""
        self._waiter = loop.create_future()
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def _wake(self, *_: object) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(False)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return  # nobody waits: the next wait arms it again
        if loop.time() < self._deadline - _TIMER_SLACK_S:
            self._timer = loop.call_at(self._deadline, self._on_timer, loop)
        else:
            self._waiter.set_result(True)


@dataclass(eq=False)
class ReqState:
    """What the HTTP process knows of one live rid (one (prompt, sample) item)."""

    rid: str
    group_rid: str | None  # the client's rid of the whole request, when it gave one
    index: int
    # every state of one generate_request call shares these; a state is in them at most once
    # (`queued`), and is put there whenever it has news for the consumer
    updates: Updates
    created_time: float = field(default_factory=time.monotonic)
    prompt_ids: list[int] = field(default_factory=list)
    logprob_start_len: int = -1
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    queued: bool = False
    is_sent: bool = False  # handed to the scheduler (so it will send one finish for it)
    # while its call's prompts are prepared (tokenized, images fetched and processed): that task
    preparing: asyncio.Task | None = None
    sent_text_len: int = 0  # characters of `text` already yielded
    sent_logprob_len: int = 0  # entries of output_token_logprobs already yielded

    def __post_init__(self) -> None:
        self.meta = {
            "id": self.rid, "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0,
            "cached_tokens": 0, "output_token_logprobs": [], "output_top_logprobs": [],
            "input_token_logprobs": [], "input_top_logprobs": [],
        }  # fmt: skip

    def notify(self) -> None:
        if not self.queued:
            self.queued = True
            self.updates.put(self)

    def finish(self, reason: FinishReason) -> None:
        self.finished = True
        self.meta["finish_reason"] = {f: getattr(reason, f) for f in _FINISH_FIELDS}
        self.meta["e2e_latency"] = time.monotonic() - self.created_time


def merge_update(state: ReqState, out: BatchStrOutput, i: int) -> None:
    """Fold update `i` of `out` into `state`: text, ids, counts, cumulative logprobs, finish."""
    new_ids = out.new_token_ids[i]
    state.text += out.texts[i]
    state.output_ids.extend(new_ids)
    meta = state.meta
    meta["prompt_tokens"] = out.prompt_tokens[i]
    meta["completion_tokens"] = out.completion_tokens[i]
    meta["cached_tokens"] = out.cached_tokens[i]
    if out.output_token_logprobs[i]:
        meta["output_token_logprobs"].extend(
            zip(out.output_token_logprobs[i], new_ids, strict=False)
        )
        meta["output_top_logprobs"].extend(_top_pairs(t) for t in out.output_top_logprobs[i])
    if out.input_token_logprobs[i]:
        # entry k is the logprob of prompt position logprob_start_len + k
        start = max(state.logprob_start_len, 0) + len(meta["input_token_logprobs"])
        ids = state.prompt_ids[start:]
        meta["input_token_logprobs"].extend(zip(out.input_token_logprobs[i], ids, strict=False))
        meta["input_top_logprobs"].extend(_top_pairs(t) for t in out.input_top_logprobs[i])
    reason = out.finished_reasons[i]
    if reason is not None:
        state.finish(reason)


def _top_pairs(top: Any) -> list[tuple[float, int]] | None:
    return None if top is None else list(zip(top.logprobs, top.token_ids, strict=True))


def output_dict(state: ReqState) -> dict[str, Any]:
    """The dict yielded for `state`. The logprob lists inside `meta_info` are the state's own
    growing lists (copying them per update would cost O(n^2)): read their new tail, the last
    `new_logprob_count` entries, before asking for the next update."""
    num_logprobs = len(state.meta["output_token_logprobs"])
    out = {
        "index": state.index,
        "text": state.text,
        "delta": state.text[state.sent_text_len :],
        "output_ids": list(state.output_ids),
        "meta_info": dict(state.meta),
        "new_logprob_count": num_logprobs - state.sent_logprob_len,
    }
    state.sent_text_len, state.sent_logprob_len = len(state.text), num_logprobs
    return out
