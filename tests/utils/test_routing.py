"""Outputs to their owners (sluice/utils/routing.py): the split of a batch output by owner,
and the Outbox's choice of socket, over real ZMQ sockets in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from sluice.messages import (
    BatchEmbeddingOutput,
    BatchStrOutput,
    FinishReason,
    InternalState,
    InternalStateReply,
    SchedulerHeartbeat,
    ToHttp,
)
from sluice.utils import ipc
from sluice.utils.routing import Outbox, split_by_owner

INBOX = ipc.Inbox(ToHttp)


def _str_output(rids: list[str]) -> BatchStrOutput:
    n = len(rids)
    return BatchStrOutput(
        rids=rids, texts=[f"t-{r}" for r in rids], new_token_ids=[[i] for i in range(n)],
        finished_reasons=[None] * (n - 1) + [FinishReason("stop")], prompt_tokens=list(range(n)),
        completion_tokens=[1] * n, cached_tokens=[0] * n, output_token_logprobs=[[]] * n,
        output_top_logprobs=[[]] * n, input_token_logprobs=[[]] * n, input_top_logprobs=[[]] * n,
    )  # fmt: skip


def test_split_keeps_each_owners_rows_in_order() -> None:
    out = _str_output(["a", "b", "c", "d"])
    parts = split_by_owner(out, ["w1", "w0", "w1", "w0"])
    assert [owner for owner, _ in parts] == ["w1", "w0"]
    w1, w0 = parts[0][1], parts[1][1]
    assert w1.rids == ["a", "c"] and w1.texts == ["t-a", "t-c"] and w1.prompt_tokens == [0, 2]
    assert w0.rids == ["b", "d"] and w0.new_token_ids == [[1], [3]]
    assert w0.finished_reasons == [None, FinishReason("stop")]


def test_one_owner_is_the_message_itself() -> None:
    out = _str_output(["a", "b"])
    assert split_by_owner(out, ["w", "w"]) == [("w", out)]


def test_shorter_lists_stay_whole() -> None:
    """An encoder's BatchEmbeddingOutput leaves `cached_tokens` empty."""
    out = BatchEmbeddingOutput(
        rids=["a", "b"], embeddings=[b"1", b"2"], prompt_tokens=[3, 4],
        finished_reasons=[FinishReason("stop")] * 2, reply_to=["x", "y"],
    )  # fmt: skip
    (_, x), (_, y) = split_by_owner(out, out.reply_to)
    assert x.rids == ["a"] and x.reply_to == ["x"] and x.cached_tokens == []
    assert y.embeddings == [b"2"] and y.prompt_tokens == [4]


def test_a_column_of_another_length_is_refused() -> None:
    out = _str_output(["a", "b", "c"])
    out.texts = ["only one"]
    with pytest.raises(ValueError, match="texts has 1 rows, not 3"):
        split_by_owner(out, ["w0", "w1", "w0"])


def test_outbox_routes_by_owner(tmp_path: Path) -> None:
    ctx = zmq.Context()
    addrs = [f"ipc://{tmp_path}/w{i}" for i in range(2)]
    pulls = [ipc.pull_socket(ctx, a) for a in addrs]
    outbox = Outbox(ctx, addrs)
    try:
        outbox.send(_str_output(["a", "b", "c"]), owners=[addrs[1], addrs[0], addrs[1]])
        outbox.send(InternalStateReply(InternalState(0, 0, 0, 0, 0, 0, 0.0), reply_to=addrs[1]))
        outbox.send(SchedulerHeartbeat(0, 0))
        outbox.send(InternalStateReply(InternalState(0, 0, 0, 0, 0, 0, 0.0), reply_to="ipc://x"))
        got = [[INBOX.decode(pull.recv()) for _ in range(3)] for pull in pulls]
        assert got[0][0].rids == ["b"] and got[1][0].rids == ["a", "c"]
        assert isinstance(got[1][1], InternalStateReply)
        assert isinstance(got[0][1], SchedulerHeartbeat)  # a heartbeat: to every worker
        assert isinstance(got[1][2], SchedulerHeartbeat)
        assert isinstance(got[0][2], InternalStateReply)  # an unknown owner: the first worker
        assert all(pull.poll(50) == 0 for pull in pulls)
    finally:
        outbox.close()
        for pull in pulls:
            pull.close(linger=0)
        ctx.term()
