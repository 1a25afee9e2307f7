"""DeadlineTracker (which timeout fires when, stale entries, heap bound); undecodable intake."""

from __future__ import annotations

from sluice.messages import SamplingParams
from sluice.scheduler.req import Req
from sluice.scheduler.timeouts import DeadlineTracker


def _req(rid: str, timeout: float = 0.0) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), 0, frozenset(), timeout=timeout)


def test_each_timeout_fires_once_with_its_kind_and_value() -> None:
    tracker = DeadlineTracker(waiting_timeout=1.0, running_timeout=5.0)
    queued, started, own = _req("q"), _req("s"), _req("o", timeout=0.5)
    live = {r.rid: r for r in (queued, started, own)}
    for req in live.values():
        tracker.add(req, now=0.0)
    started.kv_committed_len = 2  # scheduled: the waiting timeout no longer applies
    assert tracker.expired(0.4, live) == []
    due = tracker.expired(1.0, live)
    assert [(r.rid, reason.matched) for r, reason in due] == [
        ("o", "request_timeout"), ("q", "waiting_timeout"),
    ]  # fmt: skip
    assert all(reason.status_code == 503 and reason.code == "timeout" for _, reason in due)
    assert "0.5 s" in due[0][1].message and "waiting timeout" in due[1][1].message
    for req, _ in due:
        del live[req.rid]
    (req, reason), *rest = tracker.expired(5.0, live)
    assert req is started and reason.matched == "running_timeout" and not rest
    assert tracker.num_timeouts == {"waiting": 1, "running": 1, "request": 1}


def test_finished_requests_never_fire_and_the_heap_stays_bounded() -> None:
    tracker = DeadlineTracker(waiting_timeout=100.0, running_timeout=100.0)
    live: dict[str, Req] = {}
    for i in range(1000):
        req = _req(f"r{i}", timeout=50.0)
        live[req.rid] = req
        tracker.add(req, now=float(i) / 1000)
        if i % 10:
            del live[req.rid]  # finished long before its deadlines
        tracker.expired(float(i) / 1000, live)
    assert len(tracker) <= 6 * len(live) + 64
    due = tracker.expired(1000.0, live)
    assert {r.rid for r, _ in due} == set(live)


def test_an_undecodable_request_still_names_its_rid_for_the_400() -> None:
    import msgspec

    from sluice.scheduler.loop import _raw_request, _rids_of

    def rids(msg: object) -> list[tuple[str, str]]:
        raw = _raw_request(msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg))
        return [] if raw is None else _rids_of(raw)

    bad = {"rid": "r1", "input_ids": "not ids", "reply_to": "ipc://x"}
    assert rids({"type": "TokenizedGenerateReqInput", **bad}) == [("r1", "ipc://x")]
    batch = {"type": "BatchTokenizedGenerateReqInput", "reqs": [bad, {"x": 1}]}
    assert rids(batch) == [("r1", "ipc://x")]
    assert rids({"type": "BatchTokenizedGenerateReqInput", "reqs": 5}) == []
    assert rids({"type": "AbortReq", **bad}) == [] and rids(b"\xc1") == [] and rids(b"x") == []
