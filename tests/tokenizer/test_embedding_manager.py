"""EmbeddingManager without processes: a `send` that records the messages, outputs handed in
by the test. Covers ending every pending call at once (`abort_all`) and refusing new calls
while shutting down."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenizedEmbeddingReqInput,
    FinishReason,
    ModelInfo,
    TokenizedEmbeddingReqInput,
)
from sluice.tokenizer.embedding_manager import EmbeddingManager, Encoded
from sluice.tokenizer.normalize import RequestError

ENCODED = [Encoded([1, 2, 3]), Encoded([4, 5])]


def make_manager(task: str) -> tuple[EmbeddingManager, list[Any]]:
    sent: list[Any] = []
    info = ModelInfo("m", "", context_len=16, vocab_size=32, task=task, dimensions=2)
    return EmbeddingManager(None, info, sent.append, reply_to="ipc://test"), sent


def sent_rids(sent: list[Any]) -> list[str]:
    """The rids of the embedding requests among `sent`, in order."""
    rids = []
    for msg in sent:
        if isinstance(msg, BatchTokenizedEmbeddingReqInput):
            rids += [r.rid for r in msg.reqs]
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            rids.append(msg.rid)
    return rids


async def start_calls(manager: EmbeddingManager, num: int) -> list[asyncio.Task[Any]]:
    """`num` calls of ENCODED, each sent and pending when this returns."""
    tasks = [asyncio.create_task(manager.run(ENCODED)) for _ in range(num)]
    await asyncio.sleep(0)
    assert len(manager.pending) == num * len(ENCODED)
    return tasks


def output(rids: list[str], vec: bytes, reason: FinishReason) -> BatchEmbeddingOutput:
    """The scheduler's answer to `rids` (each with `vec` and 3 prompt tokens)."""
    n = len(rids)
    return BatchEmbeddingOutput(rids, [vec] * n, [3] * n, [reason] * n, ["ipc://test"] * n)


async def results(tasks: list[asyncio.Task[Any]]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)


def test_encoder_abort_all_ends_every_call_and_sends_one_abort_all() -> None:
    async def go() -> None:
        manager, sent = make_manager("embed")
        tasks = await start_calls(manager, 3)
        num_sent = len(sent)
        assert manager.abort_all(499, "request_aborted", "the request was aborted") == 6
        errors = await results(tasks)
        for err in errors:
            assert isinstance(err, RequestError)
            assert (err.status_code, err.code) == (499, "request_aborted")
        assert sent[num_sent:] == [AbortReq(abort_all=True, reason="client")]
        assert manager.pending == {}
        assert manager.abort_all(499, "request_aborted", "again") == 0
        assert len(sent) == num_sent + 1  # nothing pending: nothing sent

    asyncio.run(go())


def test_decoder_abort_all_aborts_its_own_rids_only() -> None:
    """The decoder's scheduler also runs generation requests: no abort_all=True there."""

    async def go() -> None:
        manager, sent = make_manager("generate")
        tasks = await start_calls(manager, 2)
        rids = sent_rids(sent)
        num_sent = len(sent)
        assert manager.abort_all(503, "shutdown", "shutting down", reason="shutdown") == 4
        for err in await results(tasks):
            assert isinstance(err, RequestError)
            assert (err.status_code, err.code, err.message) == (503, "shutdown", "shutting down")
        assert sent[num_sent:] == [AbortReq(rid=rid, reason="shutdown") for rid in rids]

    asyncio.run(go())


def test_output_after_abort_all_is_dropped_and_later_calls_work() -> None:
    async def go() -> None:
        manager, sent = make_manager("embed")
        tasks = await start_calls(manager, 1)
        manager.abort_all(499, "request_aborted", "aborted")
        await results(tasks)
        aborted = FinishReason(type="abort", status_code=499, code="request_aborted")
        late = sent_rids(sent)
        manager.on_output(output(late, b"", aborted))
        assert manager.pending == {}
        task = asyncio.create_task(manager.run(ENCODED))
        await asyncio.sleep(0)
        rids = list(manager.pending)
        vec = np.array([1.0, 2.0], dtype="<f4").tobytes()
        manager.on_output(output(rids, vec, FinishReason(type="stop")))
        vectors, num_tokens = await asyncio.wait_for(task, 5)
        assert num_tokens == 6 and [v.tolist() for v in vectors] == [[1.0, 2.0]] * 2

    asyncio.run(go())


def test_abort_all_ends_a_call_still_being_tokenized() -> None:
    """abort_all() lands while a call's inputs are in the tokenizer thread: the call ends with
    the same error once tokenized and never reaches the scheduler; a later call runs."""

    async def go() -> None:
        manager, sent = make_manager("embed")
        started, release = threading.Event(), threading.Event()
        encode = manager._encode_inputs

        def slow_encode(*args: Any) -> Any:
            started.set()
            release.wait()  # until the test lets it go (at the latest, in its finally)
            return encode(*args)

        manager._encode_inputs = slow_encode  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(manager.embed([[1, 2, 3], [4, 5]]))
            assert await asyncio.to_thread(started.wait, 60)
            assert manager.abort_all(499, "request_aborted", "the request was aborted") == 1
            # a second abort_all (the shutdown drain's) finds it ended already: not counted again
            assert manager.abort_all(503, "shutdown", "shutting down", reason="shutdown") == 0
            assert aborts(manager) == {"abort_request": 1}
            release.set()
            (err,) = await results([task])
            assert isinstance(err, RequestError) and (err.status_code, err.code) == (
                499,
                "request_aborted",
            )
            assert sent == [] and manager.pending == {}
            task = asyncio.create_task(manager.embed([[1, 2, 3]]))
            for _ in range(6000):  # tokenized in the thread, then sent (60 s at most)
                if manager.pending:
                    break
                await asyncio.sleep(0.01)
            vec = np.array([1.0, 2.0], dtype="<f4").tobytes()
            manager.on_output(output(sent_rids(sent), vec, FinishReason(type="stop")))
            vectors, _ = await asyncio.wait_for(task, 60)
            assert [v.tolist() for v in vectors] == [[1.0, 2.0]]
        finally:
            release.set()

    asyncio.run(go())


def test_unhealthy_manager_ends_calls_but_sends_nothing() -> None:
    async def go() -> None:
        manager, sent = make_manager("embed")
        tasks = await start_calls(manager, 1)
        manager.is_healthy = False  # the scheduler is gone: nobody to tell
        num_sent = len(sent)
        assert manager.abort_all(499, "request_aborted", "aborted") == 2
        assert all(isinstance(e, RequestError) for e in await results(tasks))
        assert len(sent) == num_sent

    asyncio.run(go())


def test_shutting_down_refuses_new_calls_and_lets_pending_ones_finish() -> None:
    async def go() -> None:
        manager, sent = make_manager("embed")
        tasks = await start_calls(manager, 1)
        num_sent = len(sent)
        manager.begin_shutdown()
        with pytest.raises(RequestError) as info:
            await manager.run(ENCODED)
        assert (info.value.status_code, info.value.code) == (503, "shutting_down")
        assert len(sent) == num_sent and len(manager.pending) == 2
        vec = np.zeros(2, dtype="<f4").tobytes()
        manager.on_output(output(list(manager.pending), vec, FinishReason(type="stop")))
        [(vectors, num_tokens)] = await results(tasks)
        assert len(vectors) == 2 and num_tokens == 6

    asyncio.run(go())


def test_an_encoder_model_refuses_past_max_queued_requests_with_429() -> None:
    from sluice.tokenizer.embedding_manager import EncoderManager
    from sluice.utils import ipc

    async def go() -> None:
        addrs = ipc.IpcAddrs.create()
        info = ModelInfo(
            "m", "", context_len=16, vocab_size=32, task="embed", dimensions=2,
            max_running_requests=3,
        )  # fmt: skip
        manager = EncoderManager(None, addrs, info, max_queued=1)
        try:
            tasks = await start_calls(manager, 2)  # 4 in flight = 3 running + 1 queued: fits
            with pytest.raises(RequestError) as refused:
                await manager.run(ENCODED[:1])
            err = refused.value
            assert (err.status_code, err.code) == (429, "queue_full")
            assert err.headers == {"Retry-After": "1"} and "4 requests in flight" in err.message
            assert manager.counters.rejected["queue_full"] == 1
            manager.abort_all(499, "request_aborted", "done")
            await results(tasks)
        finally:
            await manager.close()
            addrs.remove()

    asyncio.run(go())


# ---- counting early ends (exported by /metrics) -----------------------------------------------


def aborts(manager: EmbeddingManager) -> dict[str, int]:
    """The nonzero abort counts of `manager`, by cause."""
    return {cause: num for cause, num in manager.counters.aborts.items() if num}


def test_abort_all_counts_each_rid_once_by_its_cause() -> None:
    async def go() -> None:
        manager, sent = make_manager("generate")
        tasks = await start_calls(manager, 2)
        rids = sent_rids(sent)
        assert manager.abort_all(499, "request_aborted", "aborted") == 4
        await results(tasks)
        assert aborts(manager) == {"abort_request": 4}
        # the scheduler's echo of the aborts, and abort_all again: nothing new to count
        echo = FinishReason(type="abort", status_code=499, code="request_aborted")
        manager.on_output(output(rids, b"", echo))
        assert manager.abort_all(499, "request_aborted", "again") == 0
        assert aborts(manager) == {"abort_request": 4}
        tasks = await start_calls(manager, 1)
        assert manager.abort_all(503, "shutdown", "bye", reason="shutdown") == 2
        await results(tasks)
        assert aborts(manager) == {"abort_request": 4, "shutdown": 2}

    asyncio.run(go())


def test_a_cancelled_call_counts_its_unanswered_rids_as_disconnected() -> None:
    """The caller goes away after one of three inputs was answered: two rids ended early, each
    counted once, whether its late answer arrives before the call's cleanup or after it."""

    async def go() -> None:
        manager, sent = make_manager("embed")
        task = asyncio.create_task(manager.run([*ENCODED, Encoded([6])]))
        await asyncio.sleep(0)
        first, second, third = sent_rids(sent)
        vec = np.zeros(2, dtype="<f4").tobytes()
        manager.on_output(output([first], vec, FinishReason(type="stop")))
        task.cancel()
        manager.on_output(output([second], vec, FinishReason(type="stop")))  # before cleanup
        with pytest.raises(asyncio.CancelledError):
            await task
        manager.on_output(output([third], vec, FinishReason(type="stop")))  # after it
        assert aborts(manager) == {"client_disconnect": 2}
        assert manager.pending == {}
        assert [m for m in sent if isinstance(m, AbortReq)] == [AbortReq(rid=third)]

    asyncio.run(go())


def test_a_call_cancelled_while_tokenized_counts_once_unless_abort_all_did() -> None:
    async def go() -> None:
        manager, sent = make_manager("embed")
        release = threading.Event()
        encode = manager._encode_inputs

        def slow_encode(*args: Any) -> Any:
            release.wait()  # until the test lets it go (at the latest, in its finally)
            return encode(*args)

        manager._encode_inputs = slow_encode  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(manager.embed([[1, 2, 3], [4, 5]]))
            await asyncio.sleep(0.05)
            task.cancel()
            await results([task])
            assert aborts(manager) == {"client_disconnect": 1}
            # abort_all counts a call being tokenized; its caller leaving afterwards adds nothing
            task = asyncio.create_task(manager.embed([[1, 2, 3]]))
            await asyncio.sleep(0.05)
            assert manager.abort_all(499, "request_aborted", "aborted") == 1
            task.cancel()
            await results([task])
            release.set()
            assert aborts(manager) == {"client_disconnect": 1, "abort_request": 1}
            assert sent == []
        finally:
            release.set()

    asyncio.run(go())


def test_scheduler_abort_finishes_are_counted_by_cause() -> None:
    """A timeout, an invalid input and an internal error of the scheduler: one count each (and
    the timeout's kind); a normal finish counts nothing."""

    async def go() -> None:
        manager, sent = make_manager("embed")
        tasks = await start_calls(manager, 2)
        rids = sent_rids(sent)
        timeout = FinishReason(
            type="abort", status_code=503, code="timeout", matched="waiting_timeout"
        )
        reasons = [
            timeout,
            FinishReason(type="abort", status_code=400, code="invalid_request"),
            FinishReason(type="abort", status_code=500, code="internal_error"),
            FinishReason(type="stop"),
        ]
        for rid, reason in zip(rids, reasons, strict=True):
            manager.on_output(BatchEmbeddingOutput([rid], [b""], [3], [reason], ["ipc://test"]))
        errors = await results(tasks)
        assert [type(e) for e in errors] == [RequestError, RequestError]
        assert aborts(manager) == {"timeout": 1, "invalid": 1, "internal_error": 1}
        assert manager.counters.timeouts["waiting"] == 1
        assert not any(isinstance(m, AbortReq) for m in sent)  # all answered: nothing to abort

    asyncio.run(go())


def test_refusals_are_counted() -> None:
    async def go() -> None:
        manager, _ = make_manager("embed")
        manager.begin_shutdown()
        for _ in range(2):
            with pytest.raises(RequestError):
                await manager.run(ENCODED)
        assert manager.counters.rejected["shutting_down"] == 2
        assert aborts(manager) == {}

    asyncio.run(go())


@pytest.mark.parametrize("quantization", ["gguf", "int8", "int4"])
def test_quantization_of_an_encoder_main_model_is_refused(quantization: str) -> None:
    from sluice.checkpoint.encoder_config import default_embedding_model_path
    from sluice.config import ServerArgs
    from sluice.tokenizer.embedding_manager import plan_encoders

    path = default_embedding_model_path()
    with pytest.raises(ValueError, match=f"--quantization {quantization} applies to generative"):
        plan_encoders(ServerArgs(model_path=path, quantization=quantization))
    assert len(plan_encoders(ServerArgs(model_path=path, quantization="none"))) == 1
