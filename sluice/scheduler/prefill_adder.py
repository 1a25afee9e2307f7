"""Admission of waiting requests into the next prefill batch.

`PrefillAdder` walks the waiting queue in policy order and admits requests while three budgets
hold: free request rows, prefill tokens for this step, and KV slots. The KV budget reserves room
for the decode of every running and admitted request, scaled by `new_token_ratio` (requests
usually stop before max_new_tokens); retraction is the safety valve when that guess is wrong.
Admission stops at the first request that does not fit (no skipping ahead), so no request can be
overtaken forever. The one exception is in-batch deduplication: a request whose first
`DEDUP_LEN` tokens (fewer for a shorter prompt) miss the cache but equal those of a request admitted in this same step waits
one step, so the shared prompt is prefilled once and then hit in the cache (n > 1 samples,
bursts of requests with a common system prompt).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sluice.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sluice.scheduler.radix_cache import RadixCache
from sluice.scheduler.req import Req

# decode tokens reserved per request are capped at this (long max_tokens would block admission)
RESERVE_CLIP = 4096
DEDUP_LEN = 32


class AddResult(enum.Enum):
    ADDED = 1
    DEFERRED = 2  # wait for a request of this batch to put the shared prefix in the cache
    STOP = 3  # does not fit: admit nothing more this step


@dataclass
class PrefillAdder:
    allocator: TokenToKVPoolAllocator
    req_pool: ReqToTokenPool
    tree: RadixCache
    running: list[Req]
    max_running: int
    token_budget: int  # prefill tokens for this step
    chunked_size: int  # 0: no chunking
    new_token_ratio: float
    can_run: list[Req] = field(default_factory=list)
    new_chunked: Req | None = None
    reserved: int = 0
    pending_prefixes: set[tuple[int, ...]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.reserved = sum(self._decode_reserve(r) for r in self.running)

    def _decode_reserve(self, req: Req) -> int:
        return int(min(req.remaining_new_tokens(), RESERVE_CLIP) * self.new_token_ratio)

    def kv_headroom(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size() - self.reserved

    def add_chunked(self, req: Req) -> None:
        """Continue a request whose prompt is being prefilled chunk by chunk; it goes first."""
        remaining = req.seq_len - req.kv_committed_len
        req.extend_len = min(remaining, self.token_budget)
        req.is_chunked = req.extend_len < remaining
        self._charge(req)

    def try_add(self, req: Req) -> AddResult:
        """Admit `req` (matching and locking its cached prefix), defer it, or stop admission."""
        if len(self.running) + len(self.can_run) >= self.max_running:
            return AddResult.STOP
        if self.req_pool.available_size() == 0 or self.token_budget <= 0:
            return AddResult.STOP
        match = self.tree.match_prefix(req.fill_ids[: req.prefix_match_limit()])
        prefix_len = len(match.indices)
        if self._is_duplicate(req, prefix_len):
            return AddResult.DEFERRED
        extend = req.seq_len - prefix_len
        self.tree.inc_lock_ref(match.last_node)
        if extend + self._decode_reserve(req) > self.kv_headroom():
            self.tree.dec_lock_ref(match.last_node)
            return AddResult.STOP
        if extend > self.token_budget:
            if self.chunked_size <= 0 and self.can_run:
                self.tree.dec_lock_ref(match.last_node)
                return AddResult.STOP
            if self.chunked_size > 0:
                if self.new_chunked is not None:
                    self.tree.dec_lock_ref(match.last_node)
                    return AddResult.STOP
                extend = self.token_budget
                req.is_chunked = True
                self.new_chunked = req
        self._place(req, match.indices, match.last_node, extend)
        return AddResult.ADDED

    def _is_duplicate(self, req: Req, prefix_len: int) -> bool:
        key_len = min(DEDUP_LEN, req.seq_len - 1)
        if self.tree.disable or prefix_len >= key_len:
            return False
        key = tuple(req.fill_ids[:key_len])
        if key in self.pending_prefixes:
            return True
        self.pending_prefixes.add(key)
        return False

    def _place(self, req: Req, prefix_indices, last_node, extend: int) -> None:
        row = self.req_pool.alloc()
        assert row is not None
        prefix_len = len(prefix_indices)
        self.req_pool.req_to_token[row, :prefix_len] = prefix_indices
        req.req_pool_idx = row
        req.last_node = last_node
        req.kv_committed_len = prefix_len
        req.cache_protected_len = prefix_len
        if req.num_retractions == 0:
            req.cached_tokens += prefix_len
        req.extend_len = extend
        self._charge(req)

    def _charge(self, req: Req) -> None:
        self.can_run.append(req)
        self.token_budget -= req.extend_len
        self.reserved += req.extend_len + (0 if req.is_chunked else self._decode_reserve(req))


def sort_waiting(waiting: list[Req], policy: str, tree: RadixCache) -> list[Req]:
    """fcfs keeps arrival order; lpm puts the longest cached prefix first (fcfs among ties and
    when the queue is long, where matching every request would cost more than it saves)."""
    if policy != "lpm" or len(waiting) > 128 or tree.disable:
        return waiting
    matched = {
        id(r): len(tree.match_prefix(r.fill_ids[: r.prefix_match_limit()]).indices) for r in waiting
    }
    return sorted(waiting, key=lambda r: -matched[id(r)])
