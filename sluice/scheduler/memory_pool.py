"""Owners of the two scheduler-side memory resources: request rows and KV token slots.

`ReqToTokenPool` hands out rows of `req_to_token`, the table mapping each running request's token
positions to KV slots. `TokenToKVPoolAllocator` hands out the KV slots themselves. The KV tensors
live in the model runner; these classes only track which indices are free.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Rows of `req_to_token`: row r, position p holds the KV slot of token p of the request in r.

    A row is either free or owned by exactly one running request.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        # [size, max_context_len]; entries past a request's length are stale (ForwardBatch
        # reads slot 0 in their place)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.clear()

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self._in_use.add(idx)
        return idx

    def free(self, idx: int) -> None:
        if idx not in self._in_use:
            raise ValueError(f"req_to_token row {idx} freed but not allocated")
        self._in_use.remove(idx)
        self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)

    def clear(self) -> None:
        # reversed so that pop() hands out low rows first
        self._free: list[int] = list(range(self.size - 1, -1, -1))
        self._in_use: set[int] = set()


class TokenToKVPoolAllocator:
    """Free list of KV token slots 1..size. Slot 0 is the padding slot and is never handed out.

    Every slot is, at any time, in exactly one place: the free list (`_free` plus the pending
    frees in `_pending`) or with an owner (a request or the radix cache). Frees are appended to
    `_pending` and merged lazily on the next alloc, so freeing many small tensors stays cheap.
    With `debug=True`, every free is checked against double frees and out-of-range slots.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu", debug: bool = False):
        self.size = size
        self.device = device
        self.debug = debug
        self.clear()

    def alloc(self, num: int) -> torch.Tensor | None:
        """Int64 slot indices [num], or None (allocating nothing) if fewer than num are free."""
        if num > self.available_size():
            return None
        self._merge_pending()
        out = self._free[:num]
        self._free = self._free[num:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        # copied: the caller's tensor may be a view of a req_to_token row that gets reused
        indices = indices.to(dtype=torch.int64, device=self.device, copy=True).reshape(-1)
        if self.debug:
            self._check_free(indices)
        self._pending.append(indices)
        self._num_pending += indices.numel()

    def available_size(self) -> int:
        return self._free.numel() + self._num_pending

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._pending: list[torch.Tensor] = []
        self._num_pending = 0

    def free_slots(self) -> torch.Tensor:
        """Every free slot (a copy; for leak and ownership checks)."""
        self._merge_pending()
        return self._free.clone()

    def check_no_duplicates(self) -> None:
        """Assert the free list holds distinct slots, all within 1..size."""
        free = self.free_slots()
        assert free.numel() <= self.size, f"{free.numel()} free slots in a pool of {self.size}"
        if free.numel() == 0:
            return
        assert int(free.min()) >= 1 and int(free.max()) <= self.size, "free slot out of range"
        assert torch.unique(free).numel() == free.numel(), "a slot is on the free list twice"

    def _merge_pending(self) -> None:
        if self._pending:
            self._free = torch.cat([self._free, *self._pending])
            self._pending = []
            self._num_pending = 0

    def _check_free(self, indices: torch.Tensor) -> None:
        if int(indices.min()) < 1 or int(indices.max()) > self.size:
            raise ValueError(f"freeing slots outside 1..{self.size}")
        if torch.unique(indices).numel() != indices.numel():
            raise ValueError("freeing the same slot twice in one call")
        if torch.isin(indices, self.free_slots()).any():
            raise ValueError("double free: slot is already free")
