"""ForwardBatch's DECODE batches: `decode` (the scheduler's per-step path, NumPy on views of the
pool) against what `build` makes of the same batch as a one-token EXTEND."""

from __future__ import annotations

import torch

from sluice.model.forward_batch import ForwardBatch, ForwardMode


def _pool() -> torch.Tensor:
    """A req_to_token whose rows hold stale slots (1000 + position) past every length."""
    return 1000 + torch.arange(24, dtype=torch.int64).repeat(4, 1)


def test_decode_writes_the_new_slots_and_pads_each_row_with_slot_0() -> None:
    ids, positions, rows = [11, 12, 13], [5, 2, 9], [3, 0, 1]
    slots = torch.tensor([50, 51, 52])
    r2t = _pool()
    fb = ForwardBatch.decode(ids, positions, rows, slots, r2t.numpy())
    assert [int(r2t[r, p]) for r, p in zip(rows, positions, strict=True)] == [50, 51, 52]
    assert fb.mode == ForwardMode.DECODE and fb.batch_size == 3 and fb.max_q == 1
    assert fb.input_ids.tolist() == ids and fb.positions.tolist() == positions
    assert fb.seq_lens.tolist() == [6, 3, 10] and fb.out_cache_loc is slots
    assert fb.kv_indices.shape == (3, 10)
    for b, (r, n) in enumerate(zip(rows, [6, 3, 10], strict=True)):
        assert fb.kv_indices[b, :n].tolist() == r2t[r, :n].tolist()
        assert fb.kv_indices[b, n:].tolist() == [0] * (10 - n)
    assert fb.logits_index.tolist() == [0, 1, 2] and fb.all_logits
    assert fb.prefix_lens_cpu.tolist() == positions and fb.extend_lens_cpu.tolist() == [1, 1, 1]
    for t in (fb.input_ids, fb.positions, fb.kv_indices, fb.seq_lens, fb.logits_index):
        assert t.dtype == torch.int64 and t.is_contiguous()


def test_decode_matches_a_one_token_extend_of_the_same_batch() -> None:
    """The general path (EXTEND, one new token a request) reads the same slots and positions."""
    ids, positions, rows = [7, 8], [4, 1], [2, 0]
    slots = torch.tensor([60, 61])
    r2t = _pool()
    r2t[rows, positions] = slots
    extend = ForwardBatch.build(
        ForwardMode.EXTEND, ids, positions, [1, 1], slots, r2t, rows, [0, 1], torch.device("cpu")
    )
    via_build = ForwardBatch.build(
        ForwardMode.DECODE, ids, positions, [1, 1], slots, r2t, rows, [0, 1], torch.device("cpu")
    )
    decode = ForwardBatch.decode(ids, positions, rows, slots, _pool().numpy())
    for fb in (via_build, decode):
        for name in ("input_ids", "positions", "kv_indices", "seq_lens", "logits_index"):
            assert torch.equal(getattr(fb, name), getattr(extend, name)), name


def test_a_decode_batch_with_some_logits_rows_keeps_them() -> None:
    r2t = _pool()
    fb = ForwardBatch.build(
        ForwardMode.DECODE, [1, 2, 3], [0, 1, 2], [1, 1, 1], torch.tensor([5, 6, 7]), r2t,
        [0, 1, 2], [0, 2], torch.device("cpu"),
    )  # fmt: skip
    assert fb.logits_index.tolist() == [0, 2] and not fb.all_logits


def test_shared_prefix_is_the_slots_a_group_of_requests_reads_alike() -> None:
    """The longest run of first slots that the largest group holding one slot at position
    min_slots - 1 reads alike (with a radix cache of a token a slot, those share every slot
    before it), within each one's cached prefix (short of its new tokens' slots); none for one
    request and fewer than min_slots. Decode steps and extends alike."""

    def decode(positions: list[int], shared: int) -> ForwardBatch:
        r2t = _pool() + 100 * torch.arange(4)[:, None]  # each row its own slots
        r2t[:, :shared] = r2t[0, :shared].clone()  # but a prefix held once
        rows, slots = list(range(len(positions))), torch.arange(100, 100 + len(positions))
        return ForwardBatch.decode([1] * len(positions), positions, rows, slots, r2t.numpy())

    assert decode([9, 6, 7], shared=5).shared_prefix(3).slots == 5
    assert decode([9, 6, 7], shared=5).shared_prefix(3).requests is None  # every request
    assert decode([9, 6, 7], shared=9).shared_prefix(3).slots == 6  # request 1's slot 6: its own
    assert decode([9, 6, 7], shared=0).shared_prefix(3).slots == 0
    assert decode([9, 6, 7], shared=5).shared_prefix(6).slots == 0  # shorter than min_slots
    assert decode([9], shared=5).shared_prefix(3).slots == 0  # one request
    fb = decode([9, 6, 7], shared=5)
    fb.kv_indices[2, 4] = 99  # a slot of its own inside: the run stops there
    assert fb.shared_prefix(3).slots == 4
    fb = decode([9, 6, 7, 8], shared=5)
    fb.kv_indices[1, 1:5] = torch.arange(77, 81)  # request 1 shares only its first token's slot
    sharing = fb.shared_prefix(3)
    assert sharing.slots == 5 and sharing.requests.tolist() == [0, 2, 3] and sharing.count == 3
    assert fb.shared_prefix(3) is sharing  # kept
    assert sharing.queries == 3

    def extend(prefixes: list[int], news: list[int], shared: int) -> ForwardBatch:
        r2t = _pool() + 100 * torch.arange(4)[:, None]
        r2t[:, :shared] = r2t[0, :shared].clone()
        rows = list(range(len(prefixes)))
        ids = list(range(1, sum(news) + 1))
        return ForwardBatch.build(
            ForwardMode.EXTEND, ids, prefixes, news, torch.arange(500, 500 + sum(news)), r2t,
            rows, [sum(news) - 1], torch.device("cpu"),
        )  # fmt: skip

    sharing = extend([4, 5, 6], [3, 1, 2], shared=9).shared_prefix(
        3
    )  # the same slots past each one's prefix
    assert sharing.slots == 4 and sharing.requests is None and sharing.queries == 6
    sharing = extend([6, 6, 2], [3, 1, 2], shared=5).shared_prefix(
        3
    )  # request 2's prefix is too short
    assert sharing.slots == 5 and sharing.requests.tolist() == [0, 1] and sharing.queries == 4
    assert extend([6, 6, 2], [3, 1, 2], shared=5).shared_prefix(6).slots == 0
    assert extend([6, 6], [3, 1], shared=2).shared_prefix(3).slots == 0


def test_dense_split_spans_the_long_requests_and_builds_masks_only_when_asked() -> None:
    """`dense_split`: each request of min_queries new tokens or more as a span (its row, its
    first token, its new tokens, its prefix), the others' tokens as the rest; with
    masks=False the prefixed requests carry no slots and no mask (the AMX attention reads the
    spans alone)."""
    r2t = _pool() + 100 * torch.arange(4)[:, None]
    prefixes, news = [0, 3, 5], [6, 2, 5]
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, list(range(1, 14)), prefixes, news, torch.arange(500, 513), r2t,
        [0, 1, 2], [12], torch.device("cpu"),
    )  # fmt: skip
    split = fb.dense_split(5, torch.float32)
    assert split.spans.tolist() == [[0, 0, 6, 0], [2, 8, 5, 5]]
    assert split.rest.tolist() == [6, 7] and split.rest_rows.tolist() == [1, 1]
    assert split.requests[0][2] is None and split.requests[1][3].shape == (5, 10)
    bare = fb.dense_split(5, torch.float32, masks=False)
    assert bare.spans.tolist() == split.spans.tolist()
    assert all(r[2] is None and r[3] is None for r in bare.requests)
    assert fb.dense_split(7, torch.float32) is None
