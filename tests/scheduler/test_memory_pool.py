from __future__ import annotations

import pytest
import torch

from sluice.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


def test_req_to_token_pool_alloc_until_exhausted_then_reuse():
    pool = ReqToTokenPool(size=3, max_context_len=16)
    assert pool.req_to_token.shape == (3, 16)
    assert pool.req_to_token.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.alloc() is None
    assert pool.available_size() == 0
    pool.free(rows[1])
    assert pool.available_size() == 1
    assert pool.alloc() == rows[1]


def test_req_to_token_pool_double_free_raises_and_clear_restores():
    pool = ReqToTokenPool(size=2, max_context_len=4)
    row = pool.alloc()
    pool.free(row)
    with pytest.raises(ValueError):
        pool.free(row)
    pool.alloc()
    pool.clear()
    assert pool.available_size() == 2


def test_allocator_never_hands_out_padding_slot():
    alloc = TokenToKVPoolAllocator(size=10)
    slots = alloc.alloc(10)
    assert slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(1, 11))
    assert alloc.available_size() == 0


def test_allocator_insufficient_allocates_nothing():
    alloc = TokenToKVPoolAllocator(size=5)
    first = alloc.alloc(3)
    assert alloc.alloc(3) is None
    assert alloc.available_size() == 2
    alloc.free(first)
    assert alloc.alloc(5) is not None


def test_allocator_batched_frees_are_merged():
    alloc = TokenToKVPoolAllocator(size=8, debug=True)
    parts = [alloc.alloc(2) for _ in range(4)]
    for part in parts:
        alloc.free(part)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 8
    again = alloc.alloc(8)
    assert sorted(again.tolist()) == list(range(1, 9))
    alloc.check_no_duplicates()


def test_allocator_free_copies_caller_tensor():
    alloc = TokenToKVPoolAllocator(size=4)
    row = torch.zeros(4, dtype=torch.int64)
    row[:2] = alloc.alloc(2)
    alloc.free(row[:2])
    row[:2] = 0  # the caller reuses its buffer before the lazy merge
    alloc.check_no_duplicates()
    assert sorted(alloc.alloc(4).tolist()) == [1, 2, 3, 4]


def test_allocator_debug_rejects_double_free_and_range():
    alloc = TokenToKVPoolAllocator(size=4, debug=True)
    slots = alloc.alloc(2)
    alloc.free(slots)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slots[:1])
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([0]))
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([3, 3]))
    assert alloc.available_size() == 4


def test_check_no_duplicates_catches_double_free_without_debug():
    alloc = TokenToKVPoolAllocator(size=4)
    slots = alloc.alloc(1)
    alloc.free(slots)
    alloc.free(slots)
    with pytest.raises(AssertionError):
        alloc.check_no_duplicates()


def test_allocator_clear():
    alloc = TokenToKVPoolAllocator(size=6)
    alloc.alloc(4)
    alloc.clear()
    assert alloc.available_size() == 6
    alloc.check_no_duplicates()
