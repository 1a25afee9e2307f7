"""Sessions through the raw scheduler API: prompts built from earlier turns, KV reuse, rollback
of aborted turns, replace, close and expiry, errors, and eviction priority of open sessions.

Built prompts are checked exactly (the `Req` the scheduler made), and greedy outputs against a
plain request with the same full prompt after flushing the cache (so that one is a full prefill).
The sharp tiny llama keeps greedy outputs stable across prefix reuse.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from sluice.engine import Engine, parse_sampling_params
from sluice.messages import (
    CloseSessionReq,
    FinishReason,
    OpenSessionReq,
    SamplingParams,
    SessionParams,
    TokenizedGenerateReqInput,
)
from sluice.scheduler.memory_pool import TokenToKVPoolAllocator
from sluice.scheduler.radix_cache import RadixCache
from sluice.scheduler.req import Req
from sluice.scheduler.sessions import SessionError, SessionManager
from tests.scheduler.conftest import MakeEngine, RawDriver, RawResult
from tests.scheduler.test_grammar import BlockedPool

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}


def _ids(n: int) -> list[int]:
    """A prompt no other test sent."""
    return [random.randrange(100, 40000) for _ in range(n)]


class SessionDriver(RawDriver):
    def open(self, sid: str, timeout: float = 0.0) -> bool:
        return self.sched.open_session(OpenSessionReq(sid, timeout)).success

    def decode(self, ids: list[int]) -> str:
        return self.sched.finish_checker.tokenizer.decode(ids)

    def close(self, sid: str) -> None:
        self.sched.close_session(CloseSessionReq(sid))

    def turn(self, rid: str, ids: list[int], session: SessionParams | None, **params: Any) -> None:
        """Add a request; `self.built[rid]` is the prompt the scheduler built (None if refused)."""
        msg = TokenizedGenerateReqInput(
            rid=rid, input_ids=list(ids), sampling_params=parse_sampling_params(params or GREEDY),
            session_params=session,
        )  # fmt: skip
        self.results[rid] = RawResult()
        self.sched.add_request(msg)
        req = self.sched.reqs.get(rid)
        self.built[rid] = list(req.origin_input_ids) if req is not None else None

    def run_turn(self, rid: str, ids: list[int], session: SessionParams | None) -> RawResult:
        self.turn(rid, ids, session)
        self.run()
        return self.results[rid]

    def run_turn_with(
        self, rid: str, ids: list[int], session: SessionParams | None, **params: Any
    ) -> RawResult:
        self.turn(rid, ids, session, **{**GREEDY, "ignore_eos": False, **params})
        self.run()
        return self.results[rid]

    def reference(self, prompt: list[int], **params: Any) -> list[int]:
        """Greedy output of a plain request, fully prefilled (cache flushed first)."""
        assert self.sched.flush_cache()
        rid = f"ref-{random.getrandbits(32)}"
        self.turn(rid, prompt, None, **params)
        self.run()
        return self.results[rid].output_ids


@pytest.fixture
def drv(sharp_engine: Engine) -> SessionDriver:
    d = SessionDriver(sharp_engine)
    d.built = {}  # type: ignore[attr-defined]
    return d


def _session(sid: str, **kw: Any) -> SessionParams:
    return SessionParams(id=sid, **kw)


def _assert_error(res: RawResult, code: str, text: str) -> None:
    assert res.finish is not None and res.finish.type == "abort", res.finish
    assert (res.finish.status_code, res.finish.code) == (400, code), res.finish
    assert text in (res.finish.message or ""), res.finish.message


# ---- building turns and reusing their KV ----------------------------------------------------


def test_multi_turn_prefills_only_new_tokens(drv: SessionDriver) -> None:
    assert drv.open("chat")
    a, b, c = _ids(20), _ids(7), _ids(5)
    r1 = drv.run_turn("t1", a, _session("chat"))
    assert drv.built["t1"] == a and len(r1.output_ids) == 6
    r2 = drv.run_turn("t2", b, _session("chat"))
    ctx2 = a + r1.output_ids + b
    assert drv.built["t2"] == ctx2
    # everything but the new tokens and the last output token of t1 (which has no KV) is cached
    assert r2.cached_tokens == len(ctx2) - len(b) - 1
    r3 = drv.run_turn("t3", c, _session("chat"))
    ctx3 = ctx2 + r2.output_ids + c
    assert drv.built["t3"] == ctx3
    assert r3.cached_tokens == len(ctx3) - len(c) - 1
    assert r3.output_ids == drv.reference(ctx3)
    assert drv.sched.internal_state().num_sessions >= 1
    drv.close("chat")


def test_offset_splice_and_drop_previous_output(drv: SessionDriver) -> None:
    assert drv.open("splice")
    a, b, c = _ids(16), _ids(6), _ids(4)
    r1 = drv.run_turn("s1", a, _session("splice"))
    full1 = a + r1.output_ids
    r2 = drv.run_turn("s2", b, _session("splice", rid="s1", offset=10))
    assert drv.built["s2"] == full1[:10] + b
    assert r2.cached_tokens == 10
    assert r2.output_ids == drv.reference(full1[:10] + b)
    r3 = drv.run_turn("s3", c, _session("splice", rid="s1", drop_previous_output=True))
    assert drv.built["s3"] == a + c
    # a splice inside the output of s2
    drv.run_turn("s4", c, _session("splice", rid="s2", offset=len(full1[:10] + b) + 2))
    assert drv.built["s4"] == full1[:10] + b + r2.output_ids[:2] + c
    # the default base is the last finished turn
    drv.run_turn("s5", b, _session("splice"))
    assert (
        drv.built["s5"] == full1[:10] + b + r2.output_ids[:2] + c + drv.results["s4"].output_ids + b
    )
    assert r3.output_ids == drv.reference(a + c)
    drv.close("splice")


def test_replace_drops_the_branch_and_aborts_its_running_turn(drv: SessionDriver) -> None:
    assert drv.open("rep")
    a, b, c = _ids(12), _ids(5), _ids(5)
    r1 = drv.run_turn("p1", a, _session("rep"))
    drv.run_turn("p2", b, _session("rep", rid="p1"))
    long = {**GREEDY, "max_new_tokens": 200}
    drv.turn("p3", b, _session("rep", rid="p2"), **long)  # still running when p4 replaces
    drv.step()
    assert drv.results["p3"].finish is None
    drv.turn("p4", c, _session("rep", rid="p1", replace=True))
    assert drv.built["p4"] == a + r1.output_ids + c
    drv.run()
    p3 = drv.results["p3"].finish
    assert p3 is not None and (p3.type, p3.code) == ("abort", "session_replaced"), p3
    assert drv.results["p4"].finish.type == "length"
    # p2 (and p3) are gone: continuing them is an unknown rid; the default base is now p4
    drv.run_turn("p5", b, _session("rep", rid="p2"))
    _assert_error(drv.results["p5"], "invalid_session", "'p2'")
    drv.run_turn("p6", b, _session("rep"))
    assert drv.built["p6"] == a + r1.output_ids + c + drv.results["p4"].output_ids + b
    drv.close("rep")


def test_aborted_turn_is_rolled_back(drv: SessionDriver) -> None:
    assert drv.open("abort")
    a, b, c = _ids(12), _ids(5), _ids(5)
    r1 = drv.run_turn("q1", a, _session("abort"))
    drv.turn("q2", b, _session("abort"), **{**GREEDY, "max_new_tokens": 200})
    for _ in range(3):
        drv.step()
    drv.abort("q2")
    drv.run()
    assert drv.results["q2"].finish.code == "request_aborted"
    assert 0 < len(drv.results["q2"].output_ids) < 200
    r3 = drv.run_turn("q3", c, _session("abort"))
    assert drv.built["q3"] == a + r1.output_ids + c  # q2 left no trace in the session
    # the aborted q2 computed (and cached) KV for q1's last output token too
    assert r3.cached_tokens == len(a) + len(r1.output_ids)
    drv.run_turn("q4", c, _session("abort", rid="q2"))
    _assert_error(drv.results["q4"], "invalid_session", "'q2'")
    session = drv.sched.sessions.sessions["abort"]
    assert set(session.turns) == {"q1", "q3"} and session.num_running == 0
    drv.close("abort")


# ---- lifecycle and errors ---------------------------------------------------------------


def test_closed_session_rejects_new_turns_and_frees_its_records(drv: SessionDriver) -> None:
    before = drv.sched.internal_state().num_sessions
    assert drv.open("closing")
    assert not drv.open("closing")  # already open
    drv.run_turn("c1", _ids(8), _session("closing"))
    assert drv.sched.internal_state().num_sessions == before + 1
    drv.close("closing")
    assert drv.sched.internal_state().num_sessions == before
    assert "closing" not in drv.sched.sessions.sessions
    drv.run_turn("c2", _ids(4), _session("closing"))
    _assert_error(drv.results["c2"], "invalid_session", "not open")
    drv.close("closing")  # closing twice is harmless


def test_close_while_a_turn_runs(drv: SessionDriver) -> None:
    assert drv.open("busy")
    drv.turn("b1", _ids(8), _session("busy"), **{**GREEDY, "max_new_tokens": 20})
    drv.step()
    drv.close("busy")
    drv.run()  # the running turn finishes as a plain request
    assert drv.results["b1"].finish.type == "length"
    assert "busy" not in drv.sched.sessions.sessions


def test_idle_session_expires(drv: SessionDriver) -> None:
    assert drv.open("short", timeout=0.5)
    assert drv.open("forever")
    t0 = time.monotonic()
    drv.turn("e1", _ids(8), _session("short"), **{**GREEDY, "max_new_tokens": 20})
    drv.step()
    # a session with a running turn is not idle, however long ago it started
    assert "short" not in drv.sched.sessions.expire(t0 + 100)
    drv.run()
    sessions = drv.sched.sessions
    assert sessions.expire(t0 + 100.1) == []  # checked at most once a second
    assert sessions.expire(time.monotonic() + 200) == ["short"]
    assert "forever" in sessions.sessions
    drv.run_turn("e2", _ids(4), _session("short"))
    _assert_error(drv.results["e2"], "invalid_session", "not open")
    drv.close("forever")


def test_invalid_session_params_are_400(drv: SessionDriver) -> None:
    drv.run_turn("u1", _ids(4), _session("nope"))
    _assert_error(drv.results["u1"], "invalid_session", "'nope' is not open")
    assert drv.open("errs")
    a = _ids(6)
    drv.run_turn("u2", a, _session("errs", rid="missing"))
    _assert_error(drv.results["u2"], "invalid_session", "no finished request with rid 'missing'")
    r3 = drv.run_turn("u3", a, _session("errs"))
    drv.run_turn("u4", a, _session("errs", rid="u3", offset=len(a) + len(r3.output_ids) + 1))
    _assert_error(drv.results["u4"], "invalid_session", "offset")
    drv.run_turn("u5", a, _session("errs", offset=-1))
    _assert_error(drv.results["u5"], "invalid_session", "offset")
    drv.turn("u6", a, _session("errs"), **{**GREEDY, "max_new_tokens": 50})
    drv.turn("u7", a, _session("errs", rid="u6"))
    drv.step()  # the refusal is reported with the next step's outputs
    _assert_error(drv.results["u7"], "invalid_session", "has not finished")
    drv.run_turn("u3", a, _session("errs", rid="u6"))  # a rid the session already holds
    drv.run()
    _assert_error(drv.results["u3"], "invalid_session", "already has a request")
    session = drv.sched.sessions.sessions["errs"]
    assert set(session.turns) == {"u3", "u6"}
    drv.close("errs")


def test_capacity_of_str_len_bounds_each_turns_prompt(drv: SessionDriver) -> None:
    """A turn whose full prompt (context plus new ids) is over the capacity is refused, and the
    session goes on from its last good turn."""
    assert drv.sched.open_session(OpenSessionReq("cap", 0.0, 20)).success
    first = drv.run_turn("c1", _ids(8), _session("cap"))  # 8 + 6 output tokens: 14
    assert first.finish.type == "length"
    drv.run_turn("c2", _ids(7), _session("cap"))  # 14 + 7 = 21 > 20
    _assert_error(drv.results["c2"], "invalid_session", "21 tokens, over the session's")
    ok = drv.run_turn("c3", _ids(6), _session("cap"))  # 14 + 6 = 20: fits
    assert ok.finish.type == "length" and len(drv.built["c3"]) == 20
    drv.close("cap")


# ---- eviction priority --------------------------------------------------------------------


def test_open_session_prefix_is_evicted_last(make_engine: MakeEngine, sharp_llama_dir: str) -> None:
    engine = make_engine(sharp_llama_dir, max_total_tokens=256)
    drv = SessionDriver(engine)
    drv.built = {}  # type: ignore[attr-defined]
    assert drv.open("kept")
    a, other = _ids(60), _ids(60)
    r1 = drv.run_turn("k1", a, _session("kept"))  # the oldest entry of the cache
    drv.run_turn("plain", other, None)
    for i in range(3):  # each needs most of the pool: evictions happen
        drv.run_turn(f"fill{i}", _ids(100), None)
    r2 = drv.run_turn("k2", _ids(5), _session("kept"))
    assert r2.cached_tokens == len(a) + len(r1.output_ids) - 1
    assert drv.run_turn("plain-again", other, None).cached_tokens == 0  # evicted, newer as it was
    # closed: the session's nodes are plain LRU entries again
    drv.close("kept")
    for i in range(3):
        drv.run_turn(f"fill-after{i}", _ids(100), None)
    k3 = drv.built["k2"] + drv.results["k2"].output_ids
    assert drv.run_turn("k3-plain", k3 + _ids(3), None).cached_tokens == 0


def test_evict_order_with_keep_tags() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64))
    slots = tree.allocator.alloc(12)
    tree.insert([1, 2, 3], slots[0:3], tag="s")  # oldest
    tree.insert([4, 5, 6], slots[3:6])
    tree.insert([7, 8, 9], slots[6:9], tag="gone")
    tree.insert([1, 2, 3, 10, 11, 12], torch.cat([slots[0:3], slots[9:12]]), tag="s")
    assert tree.evict(3, keep_tags={"s"}) == 3
    assert tree.match_prefix([4, 5, 6]).indices.numel() == 0  # LRU among the untagged
    assert tree.evict(3, keep_tags={"s"}) == 3  # "gone" is not kept
    assert tree.match_prefix([7, 8, 9]).indices.numel() == 0
    assert len(tree.match_prefix([1, 2, 3, 10, 11, 12]).indices) == 6
    assert tree.evict(100, keep_tags={"s"}) == 6  # then the kept ones, when nothing else is left
    assert tree.total_size() == 0 and tree.allocator.available_size() == 64


# ---- the manager alone ----------------------------------------------------------------------


def test_manager_strips_bos_of_a_continuation_only() -> None:
    mgr = SessionManager(bos_token_id=1)
    assert mgr.open(OpenSessionReq("s"), 0.0) is None
    assert mgr.open(OpenSessionReq("s"), 0.0) is not None  # already open
    first = mgr.plan(_session("s"), "r1", [1, 5, 6])
    assert first.input_ids == [1, 5, 6]  # nothing to continue: the BOS stays
    req = Req("r1", first.input_ids, SamplingParams(max_new_tokens=2), 0, frozenset())
    assert mgr.start(first, req, 1.0) == []
    req.output_ids = [7, 8]
    req.finished_reason = FinishReason(type="length")
    mgr.on_finish(req, 2.0)
    assert mgr.plan(_session("s"), "r2", [1, 9]).input_ids == [1, 5, 6, 7, 8, 9]
    assert mgr.plan(_session("s", offset=0), "r2", [1, 9]).input_ids == [1, 9]
    with pytest.raises(SessionError, match="not open"):
        mgr.plan(_session("x"), "r2", [1])
    assert len(mgr) == 1 and mgr.close("s") and len(mgr) == 0


# ---- turns with a grammar -------------------------------------------------------------------


def test_session_turns_with_grammars(drv: SessionDriver) -> None:
    """A turn's grammar constrains that turn's output only; a turn refused for its grammar or
    aborted while it compiles leaves the session as it was."""
    assert drv.open("constrained")
    a, b = _ids(10), _ids(6)
    r1 = drv.run_turn_with("g1", a, _session("constrained"), regex="[0-9]{5}", max_new_tokens=8)
    assert drv.decode(r1.output_ids).isdigit() and r1.finish.type == "stop"
    bad = drv.run_turn_with("g2", b, _session("constrained"), regex="((", max_new_tokens=4)
    _assert_error(bad, "invalid_grammar", "regex")
    r3 = drv.run_turn_with("g3", b, _session("constrained"), regex="(yes|no)", max_new_tokens=4)
    assert drv.built["g3"] == a + r1.output_ids + b  # the refused turn left no trace
    assert drv.decode(r3.output_ids) in ("yes", "no")
    with BlockedPool(drv.sched.grammars):  # a turn that is still compiling, then aborted
        drv.turn("g4", b, _session("constrained"), regex="(held|back)", max_new_tokens=4)
        drv.step()
        assert drv.sched.internal_state().num_grammar_reqs == 1
        drv.abort("g4")
        drv.run()
    assert drv.results["g4"].finish.status_code == 499
    r5 = drv.run_turn_with("g5", b, _session("constrained"), max_new_tokens=3)
    assert drv.built["g5"] == a + r1.output_ids + b + r3.output_ids + b
    assert len(r5.output_ids) == 3
    drv.close("constrained")


def test_a_replacing_turn_whose_grammar_fails_to_compile_replaces_nothing(
    drv: SessionDriver,
) -> None:
    """The replace takes effect when the turn's grammar is ready: a grammar that turns out
    not to compile leaves the branch it would have replaced."""
    assert drv.open("keep")
    a, b, c = _ids(12), _ids(5), _ids(5)
    r1 = drv.run_turn("k1", a, _session("keep"))
    r2 = drv.run_turn("k2", b, _session("keep", rid="k1"))
    with BlockedPool(drv.sched.grammars):  # queued, so the failure comes after the turn began
        drv.turn(
            "k3", c, _session("keep", rid="k1", replace=True), regex="((never", max_new_tokens=4
        )
        drv.step()
    drv.run()
    _assert_error(drv.results["k3"], "invalid_grammar", "regex")
    drv.run_turn("k4", c, _session("keep", rid="k2"))
    assert drv.built["k4"] == a + r1.output_ids + b + r2.output_ids + c
    drv.close("keep")
