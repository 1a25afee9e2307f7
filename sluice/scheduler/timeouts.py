"""Deadlines of live requests: the waiting timeout, the running timeout and each request's own.

Owner of one heap of (deadline, seq, kind, req) entries, pushed when a request is taken in. Each
scheduler step asks for the entries that are due (`expired`): O(1) when none is, O(log n) per
due entry. An entry whose request finished, or (waiting kind) was scheduled, is stale and
dropped when it surfaces; the heap is rebuilt from the live entries whenever stale ones
outnumber them, so it never holds more than about twice the live entries.

A request is "scheduled" once any of its prompt has KV or it produced a token: the waiting
timeout covers only the time before that, the running and per-request timeouts the whole life
from intake.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from sluice.aborts import abort
from sluice.messages import FinishReason
from sluice.scheduler.req import Req

WAITING, RUNNING, REQUEST = "waiting", "running", "request"
_MIN_REBUILD = 64


@dataclass(order=True)
class _Entry:
    deadline: float
    seq: int
    kind: str
    limit: float
    req: Req


class DeadlineTracker:
    def __init__(self, waiting_timeout: float, running_timeout: float) -> None:
        self.waiting_timeout = waiting_timeout
        self.running_timeout = running_timeout
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self.num_timeouts: dict[str, int] = {WAITING: 0, RUNNING: 0, REQUEST: 0}

    def add(self, req: Req, now: float) -> None:
        for kind, limit in (
            (WAITING, self.waiting_timeout),
            (RUNNING, self.running_timeout),
            (REQUEST, req.timeout),
        ):
            if limit > 0:
                heapq.heappush(self._heap, _Entry(now + limit, next(self._seq), kind, limit, req))

    def expired(self, now: float, live: dict[str, Req]) -> list[tuple[Req, FinishReason]]:
        """The live requests whose deadline passed, each with its timeout finish reason."""
        due: list[tuple[Req, FinishReason]] = []
        seen: set[int] = set()
        while self._heap and self._heap[0].deadline <= now:
            entry = heapq.heappop(self._heap)
            if _applies(entry, live) and id(entry.req) not in seen:
                seen.add(id(entry.req))
                self.num_timeouts[entry.kind] += 1
                due.append((entry.req, timeout_reason(entry.kind, entry.limit)))
        if len(self._heap) > max(_MIN_REBUILD, 6 * len(live)):
            self._heap = [e for e in self._heap if _applies(e, live)]
            heapq.heapify(self._heap)
        return due

    def __len__(self) -> int:
        return len(self._heap)


def _applies(entry: _Entry, live: dict[str, Req]) -> bool:
    req = entry.req
    if live.get(req.rid) is not req or req.is_finished or req.to_abort is not None:
        return False
    return entry.kind != WAITING or not is_scheduled(req)


def is_scheduled(req: Req) -> bool:
    return req.first_token_time is not None or req.kv_committed_len > 0


def timeout_reason(kind: str, limit: float) -> FinishReason:
    if kind == WAITING:
        what = f"was not scheduled within the waiting timeout of {limit:g} s"
    elif kind == RUNNING:
        what = f"did not finish within the running timeout of {limit:g} s"
    else:
        what = f"did not finish within its timeout of {limit:g} s"
    return abort(503, "timeout", f"{kind} timeout: the request {what}", matched=f"{kind}_timeout")
