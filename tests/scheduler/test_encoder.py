"""EncoderScheduler against a fake encoder: batching under the token budget, validation,
abort of waiting requests, and outputs that keep each request's own vector."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from sluice.messages import AbortReq, TokenizedEmbeddingReqInput
from sluice.scheduler.encoder import EncoderScheduler


class FakeEncoder:
    """The vector of a sequence is [len, first id]; records the batch sizes it ran."""

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.fail = fail

    def forward(self, seqs, token_types=None) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        self.batches.append(len(seqs))
        return torch.tensor([[len(s), s[0]] for s in seqs], dtype=torch.float32)


def _req(rid: str, n: int, first: int = 1) -> TokenizedEmbeddingReqInput:
    return TokenizedEmbeddingReqInput(rid=rid, input_ids=[first] + [2] * (n - 1), reply_to="r")


def _scheduler(enc: FakeEncoder, budget: int = 40) -> EncoderScheduler:
    return EncoderScheduler(
        enc, vocab_size=100, context_len=32, max_batch_tokens=budget, max_batch_reqs=8
    )


def _vectors(out) -> dict[str, list[float]]:
    return {
        r: np.frombuffer(e, dtype="<f4").tolist()
        for r, e in zip(out.rids, out.embeddings, strict=True)
    }


def test_batches_fill_the_padded_token_budget_in_order() -> None:
    enc = FakeEncoder()
    s = _scheduler(enc)
    for i in range(6):
        s.add_request(_req(f"r{i}", 10, first=i + 3))  # 10 tokens each: 4 fit a budget of 40
    first = s.step()
    assert enc.batches == [4] and first.rids == ["r0", "r1", "r2", "r3"]
    assert _vectors(first)["r2"] == [10.0, 5.0]
    second = s.step()
    assert second.rids == ["r4", "r5"] and all(f.type == "length" for f in second.finished_reasons)
    assert second.prompt_tokens == [10, 10] and second.reply_to == ["r", "r"]
    assert s.is_idle() and not s.has_work() and s.step() is None


def test_a_long_request_runs_alone_and_padding_counts() -> None:
    enc = FakeEncoder()
    s = _scheduler(enc, budget=40)
    s.add_request(_req("short", 2))
    s.add_request(_req("long", 30))  # 2 x 30 padded tokens > 40
    s.step()
    s.step()
    assert enc.batches == [1, 1]


def test_invalid_inputs_finish_with_400_without_running() -> None:
    enc = FakeEncoder()
    s = _scheduler(enc)
    s.add_request(TokenizedEmbeddingReqInput(rid="empty", input_ids=[]))
    s.add_request(TokenizedEmbeddingReqInput(rid="oov", input_ids=[1, 100]))
    s.add_request(_req("long", 33))
    s.add_request(TokenizedEmbeddingReqInput(rid="types", input_ids=[1, 2], token_type_ids=[0]))
    out = s.step()
    assert out.rids == ["empty", "oov", "long", "types"]
    assert all(f.type == "abort" and f.status_code == 400 for f in out.finished_reasons)
    assert out.embeddings == [b""] * 4 and enc.batches == []


def test_abort_ends_waiting_requests_only() -> None:
    s = _scheduler(FakeEncoder())
    for rid in ("a", "b", "c"):
        s.add_request(_req(rid, 3))
    s.abort(AbortReq(rid="b"))
    out = s.step()
    reasons = dict(zip(out.rids, out.finished_reasons, strict=True))
    assert reasons["b"].type == "abort" and reasons["b"].status_code == 499
    assert reasons["a"].type == reasons["c"].type == "length"
    s.add_request(_req("d", 3))
    s.add_request(_req("e", 3))
    s.abort(AbortReq(abort_all=True))
    assert s.internal_state().num_waiting_reqs == 0  # at once: later requests are not hit
    s.add_request(_req("f", 3))
    out = s.step()
    assert [f.status_code for f in out.finished_reasons] == [499, 499, 0]
    assert out.rids == ["d", "e", "f"] and out.finished_reasons[2].type == "length"


def test_a_failing_forward_fails_its_batch_with_500() -> None:
    s = _scheduler(FakeEncoder(fail=True))
    s.add_request(_req("a", 3))
    out = s.step()
    assert out.finished_reasons[0].status_code == 500 and "boom" in out.finished_reasons[0].message
    state = s.internal_state()
    assert (state.kv_total, state.num_running_reqs, state.num_waiting_reqs) == (0, 0, 0)


def test_label_token_ids_need_a_decoder_model() -> None:
    enc = FakeEncoder()
    s = _scheduler(enc)
    s.add_request(TokenizedEmbeddingReqInput(rid="s", input_ids=[1, 2], label_token_ids=[3]))
    out = s.step()
    reason = out.finished_reasons[0]
    assert (out.rids, reason.status_code, reason.code) == (["s"], 400, "invalid_request")
    assert "label-token scoring needs a decoder model" in reason.message
    assert out.embeddings == [b""] and enc.batches == []


def test_requests_that_wait_past_the_timeout_end_with_503(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("sluice.scheduler.encoder.time.monotonic", lambda: clock[0])
    enc = FakeEncoder()
    s = EncoderScheduler(
        enc, vocab_size=100, context_len=32, max_batch_tokens=20, max_batch_reqs=8,
        waiting_timeout=5.0, running_timeout=3.0,
    )  # fmt: skip
    s.add_request(_req("old", 10))
    clock[0] += 2.0
    s.add_request(_req("young", 10))
    clock[0] += 1.5  # "old" waited 3.5 s > the shorter timeout (running, 3 s); "young" 1.5 s
    out = s.step()
    reasons = dict(zip(out.rids, out.finished_reasons, strict=True))
    assert reasons["old"].type == "abort" and reasons["old"].status_code == 503
    assert reasons["old"].code == "timeout" and "3 s" in reasons["old"].message
    assert reasons["young"].type == "length" and enc.batches == [1]
    assert s.num_timeouts == 1 and s.is_idle() and not s.arrivals


def test_many_aborts_are_applied_once_at_the_next_step() -> None:
    enc = FakeEncoder()
    s = _scheduler(enc, budget=400)
    for i in range(50):
        s.add_request(_req(f"r{i}", 2))
    for i in range(0, 50, 2):
        s.abort(AbortReq(rid=f"r{i}"))
    s.abort(AbortReq(rid="never-seen"))
    assert len(s.waiting) == 50 and s.has_work()  # marked, not yet ended
    out = s.step()
    reasons = dict(zip(out.rids, out.finished_reasons, strict=True))
    assert sum(r.type == "abort" for r in reasons.values()) == 25
    assert reasons["r0"].status_code == 499 and reasons["r1"].type == "length"
    assert enc.batches == [8] and not s.to_abort  # then the first 8 of the other 25 ran
    s.add_request(_req("r0", 2))  # the rid is free again: it left the queue
    assert not s.outputs


def test_paused_runs_no_batch_but_ends_aborts_and_continues() -> None:
    enc = FakeEncoder()
    s = _scheduler(enc)
    s.set_paused(True)
    for rid in ("a", "b"):
        s.add_request(_req(rid, 3))
    assert s.step() is None and enc.batches == [] and s.internal_state().paused
    s.abort(AbortReq(rid="a"))
    out = s.step()
    assert out.rids == ["a"] and out.finished_reasons[0].status_code == 499 and enc.batches == []
    s.set_paused(False)
    out = s.step()
    assert out.rids == ["b"] and enc.batches == [1] and not s.internal_state().paused


def test_the_encoder_process_loop_answers_every_request_it_cannot_take(monkeypatch) -> None:
    """The same loop as the decoder's: an undecodable request is a 400, a failing intake a
    500, a generation request a 400 (in generation's output type), a failing flush still gets
    its reply; none of them stops the loop."""
    import msgspec

    from sluice.messages import (
        BatchTokenIDOutput,
        BatchTokenizedEmbeddingReqInput,
        FlushCacheReply,
        FlushCacheReq,
        SamplingParams,
    )
    from sluice.messages import TokenizedGenerateReqInput as Gen
    from sluice.scheduler.encoder_process import EncoderCore
    from sluice.scheduler.loop import ModelLoop
    from sluice.utils import ipc

    s = _scheduler(FakeEncoder())
    real_add = s.add_request

    def add(msg: TokenizedEmbeddingReqInput) -> None:
        if msg.rid == "boom":
            raise RuntimeError("intake failed")
        real_add(msg)

    s.add_request = add  # type: ignore[method-assign]
    s.flush_cache = lambda: 1 / 0  # type: ignore[method-assign]
    heartbeat = ipc.HeartbeatTimer(1e9)
    heartbeat.last = 1e18
    sent: list[Any] = []
    outbox = SimpleNamespace(send=sent.append)  # what the loop sends, in order
    loop = ModelLoop(EncoderCore(s, {}), None, outbox, heartbeat)
    no_ids = {"type": "TokenizedEmbeddingReqInput", "rid": "bad", "reply_to": "w"}
    inbox = [
        ipc.encode(BatchTokenizedEmbeddingReqInput([_req("ok", 3), _req("boom", 3)])),
        msgspec.msgpack.encode(no_ids),
        ipc.encode(Gen("gen", [1, 2], SamplingParams(), reply_to="r")),
        msgspec.msgpack.encode({"type": "NoSuchMessage"}),
        ipc.encode(FlushCacheReq()),
    ]
    monkeypatch.setattr(ipc, "recv_all", lambda sock, timeout: [inbox.pop(0)] if inbox else [])
    for _ in range(7):
        loop.run_once()
    assert sent.pop() == FlushCacheReply(False)
    outs = {rid: m for m in sent for rid in m.rids}
    assert isinstance(outs["gen"], BatchTokenIDOutput)
    reasons = {rid: f for m in sent for rid, f in zip(m.rids, m.finished_reasons, strict=True)}
    assert reasons["ok"].type == "length"
    assert (reasons["boom"].status_code, reasons["bad"].status_code) == (500, 400)
    assert reasons["gen"].status_code == 400 and "cannot generate" in reasons["gen"].message
    assert set(reasons) == {"ok", "boom", "bad", "gen"} and s.is_idle()
