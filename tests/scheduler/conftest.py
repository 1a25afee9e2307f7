"""Engine fixtures for the scheduler tests, and the idle invariant checked after every test.

Engines are module-scoped (loading costs a second or so each) and built through `make_engine`,
which registers them; after every test, every live engine must be idle with its KV pool whole:
each slot free or owned by the radix cache, exactly once.

`sharp_llama_dir` is a tiny llama with large random weights: its logits are peaked (top-2 gaps of
1e-3 and more), so greedy and seeded outputs do not flip on float32 noise between batch shapes,
chunk sizes or recomputation after retraction. The stock tiny models have near-uniform logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from sluice.engine import Engine, parse_sampling_params
from sluice.messages import AbortReq, FinishReason, TokenizedGenerateReqInput
from tests.tiny_models import make_tiny_llama

_LIVE_ENGINES: list[Engine] = []

MakeEngine = Callable[..., Engine]


@pytest.fixture(scope="session")
def sharp_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    out = tmp_path_factory.mktemp("sharp_llama")
    return make_tiny_llama(out, tokenizer_dir=smollm2_hf_dir, initializer_range=0.5)


@pytest.fixture(scope="module")
def make_engine() -> Iterator[MakeEngine]:
    """Engine(model_dir, **server_args) with invariant checks on, one compute thread
    (`torch.set_num_threads` is process-wide) and float32; shut down with the module."""
    made: list[Engine] = []

    def make(model_dir: str | None, **server_args: Any) -> Engine:
        server_args.setdefault("check_invariants", True)
        # one thread: on a shared 2-core machine, 2 OpenMP threads run many times slower
        server_args.setdefault("num_threads", 1)
        # these tests compare greedy tokens and vectors across batch shapes, chunking, the
        # prefix cache, retraction and transformers: float32, whatever `auto` means here
        server_args.setdefault("dtype", "float32")
        engine = Engine(model_dir, **server_args)
        made.append(engine)
        _LIVE_ENGINES.append(engine)
        return engine

    yield make
    for engine in made:
        _LIVE_ENGINES.remove(engine)
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny_engine(make_engine: MakeEngine, tiny_llama_dir: str) -> Engine:
    return make_engine(tiny_llama_dir, max_total_tokens=4096)


@pytest.fixture(scope="module")
def sharp_engine(make_engine: MakeEngine, sharp_llama_dir: str) -> Engine:
    return make_engine(sharp_llama_dir, max_total_tokens=8192)


@pytest.fixture(scope="module")
def default_engine(make_engine: MakeEngine) -> Engine:
    """SmolLM2-135M; chunking off, so it is the reference for chunked-prefill tests."""
    return make_engine(None, max_total_tokens=2048, chunked_prefill_size=0)


@pytest.fixture(autouse=True)
def _idle_invariant() -> Iterator[None]:
    yield
    for engine in _LIVE_ENGINES:
        sched = engine.scheduler
        busy = sched.has_work()
        if busy:  # leave the engine usable for the next test before failing this one
            sched.abort(AbortReq(abort_all=True))
            RawDriver(engine).run()
        assert not busy, "a test left requests in the scheduler"
        check_pool_whole(engine)


def check_pool_whole(engine: Engine) -> None:
    """The scheduler is idle and every KV slot is free or cached, exactly once."""
    sched = engine.scheduler
    sched.check_idle_invariant()
    sched.tree.check_invariants()
    slots = torch.cat([sched.allocator.free_slots(), sched.tree.all_slots()])
    expected = torch.arange(1, sched.allocator.size + 1, dtype=slots.dtype)
    assert torch.equal(slots.sort().values, expected), "a KV slot is lost or owned twice"
    assert engine.detokenizer.num_states() == 0, "detokenizer state left behind"
    state = sched.internal_state()
    assert (state.num_running_reqs, state.num_waiting_reqs, state.kv_in_use) == (0, 0, 0)


@dataclass
class RawResult:
    output_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    updates: list[list[int]] = field(default_factory=list)  # new token ids of each update


class RawDriver:
    """Drives an engine's scheduler by hand: add requests, step, abort, collect the outputs."""

    def __init__(self, engine: Engine) -> None:
        self.sched = engine.scheduler
        self.results: dict[str, RawResult] = {}

    def add(
        self,
        rid: str,
        input_ids: list[int],
        stream: bool = False,
        reply_to: str = "",
        **params: Any,
    ) -> None:
        msg = TokenizedGenerateReqInput(
            rid=rid, input_ids=list(input_ids), sampling_params=parse_sampling_params(params),
            stream=stream, reply_to=reply_to,
        )  # fmt: skip
        self.results[rid] = RawResult()
        self.sched.add_request(msg)

    def abort(self, rid: str) -> None:
        self.sched.abort(AbortReq(rid=rid))

    def step(self) -> None:
        out = self.sched.step()
        if out is None:
            return
        for i, rid in enumerate(out.rids):
            res = self.results.setdefault(rid, RawResult())
            assert res.finish is None, f"{rid} reported after it finished"
            res.output_ids.extend(out.new_token_ids[i])
            res.updates.append(list(out.new_token_ids[i]))
            res.finish = out.finished_reasons[i]
            res.completion_tokens = out.completion_tokens[i]
            res.cached_tokens = out.cached_tokens[i]

    def run(self, max_steps: int = 20_000) -> None:
        """Step until the scheduler has nothing left; a bounded loop, so a livelock fails."""
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError(f"scheduler still busy after {max_steps} steps")


@pytest.fixture
def raw() -> Callable[[Engine], RawDriver]:
    return RawDriver
