"""Retraction under KV pressure, and a seeded random stress of the raw scheduler API.

A tiny KV pool forces `_make_room_for_decode` to retract running requests; they must come back
and finish with exactly the tokens an unconstrained engine produces (greedy and seeded sampling
both, as a request's draws depend only on its seed and output position).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import sluice.scheduler.scheduler as scheduler_module
from sluice.engine import Engine
from sluice.scheduler.scheduler import Scheduler

NUM_REQS, NEW_TOKENS = 8, 64


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def count_retractions(sched: Scheduler) -> list[int]:
    """Wrap `_make_room_for_decode`; the returned list gets the number retracted per call.

    (The scheduler has no retraction counter of its own; victims are the live requests whose
    `num_retractions` went up.)"""
    counts: list[int] = []
    make_room = sched._make_room_for_decode

    def counting() -> None:
        before = sum(r.num_retractions for r in sched.reqs.values())
        make_room()
        after = sum(r.num_retractions for r in sched.reqs.values())
        if after > before:
            counts.append(after - before)

    sched._make_room_for_decode = counting  # type: ignore[method-assign]
    return counts


def set_new_token_ratio(sched: Scheduler, ratio: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admit as if requests used only `ratio` of their max_new_tokens: a low ratio overcommits
    the pool on purpose, so retraction runs many times."""
    monkeypatch.setattr(scheduler_module, "NEW_TOKEN_RATIO_INIT", ratio)
    sched.new_token_ratio = ratio


def random_prompts() -> list[list[int]]:
    rng = random.Random(5)
    vocab = range(100, 40000)
    return [[rng.choice(vocab) for _ in range(rng.randint(6, 30))] for _ in range(NUM_REQS)]


@pytest.fixture(scope="module")
def tight_engine(make_engine: Any, sharp_llama_dir: str) -> Engine:
    """A pool of 240 slots: one request (at most 94 tokens) fits, eight cannot."""
    return make_engine(sharp_llama_dir, max_total_tokens=240, max_running_requests=8)


@pytest.mark.parametrize("ratio", [scheduler_module.NEW_TOKEN_RATIO_INIT, 0.05])
@pytest.mark.parametrize("policy", ["greedy", "seeded"])
def test_retracted_requests_finish_with_the_same_tokens(
    tight_engine: Engine,
    sharp_engine: Engine,
    policy: str,
    ratio: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_new_token_ratio(tight_engine.scheduler, ratio, monkeypatch)
    prompts = random_prompts()
    params = [
        greedy(NEW_TOKENS)
        if policy == "greedy"
        else {**greedy(NEW_TOKENS), "temperature": 0.7, "top_p": 0.9, "seed": 100 + i}
        for i in range(NUM_REQS)
    ]
    want = sharp_engine.generate(input_ids=prompts, sampling_params=params)
    retractions = count_retractions(tight_engine.scheduler)
    got = tight_engine.generate(input_ids=prompts, sampling_params=params)
    assert sum(retractions) > 0, "the pool was big enough: nothing was retracted"
    for g, w in zip(got, want, strict=True):
        assert g["meta_info"]["finish_reason"] == {"type": "length"}
        assert g["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert g["output_ids"] == w["output_ids"]


def test_retraction_keeps_logprobs_aligned(
    tight_engine: Engine, sharp_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_new_token_ratio(tight_engine.scheduler, 0.05, monkeypatch)
    prompts = random_prompts()
    want = sharp_engine.generate(
        input_ids=prompts, sampling_params=greedy(NEW_TOKENS), return_logprob=True
    )
    retractions = count_retractions(tight_engine.scheduler)
    got = tight_engine.generate(
        input_ids=prompts, sampling_params=greedy(NEW_TOKENS), return_logprob=True
    )
    assert len(retractions) >= 3
    for g, w in zip(got, want, strict=True):
        lps = g["meta_info"]["output_token_logprobs"]
        assert len(lps) == NEW_TOKENS
        assert lps == pytest.approx(w["meta_info"]["output_token_logprobs"], abs=1e-4)


def test_retracted_request_reports_its_original_cached_tokens(
    tight_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cached_tokens counts the prefix hit at first admission, not the re-admissions'."""
    set_new_token_ratio(tight_engine.scheduler, 0.05, monkeypatch)
    tight_engine.scheduler.flush_cache()
    prompts = random_prompts()
    tight_engine.generate(input_ids=prompts[0][:5], sampling_params=greedy(1))
    retractions = count_retractions(tight_engine.scheduler)
    got = tight_engine.generate(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    assert len(retractions) >= 3
    assert [g["meta_info"]["cached_tokens"] for g in got] == [5] + [0] * (NUM_REQS - 1)


def test_abort_of_a_retracted_request(
    tight_engine: Engine, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = tight_engine.scheduler
    set_new_token_ratio(sched, 0.05, monkeypatch)
    driver = raw(tight_engine)
    for i, ids in enumerate(random_prompts()):
        driver.add(f"q{i}", ids, **greedy(NEW_TOKENS))
    for _ in range(500):
        victims = [r for r in sched.waiting if r.num_retractions > 0]
        if victims:
            break
        driver.step()
    assert victims, "nothing was retracted"
    victim = victims[0]
    assert victim.req_pool_idx is None and len(victim.output_ids) > 0
    driver.abort(victim.rid)
    driver.run()
    res = driver.results[victim.rid]
    assert res.finish.type == "abort" and res.completion_tokens == len(victim.output_ids)
    others = [r for rid, r in driver.results.items() if rid != victim.rid]
    assert all(r.completion_tokens == NEW_TOKENS for r in others)


# ---- randomized stress ----------------------------------------------------------------------


def _random_params(rng: random.Random) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": rng.choice([0, 1, 2, 5, 17, 40, 80, 120]),
        "ignore_eos": rng.random() < 0.8,
    }
    kind = rng.random()
    if kind < 0.4:
        params["temperature"] = 0.0
    elif kind < 0.8:
        params.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000))
        params.update(top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([-1, 20]))
    else:
        params.update(temperature=0.8, seed=rng.randrange(1000), repetition_penalty=1.2)
        params.update(min_new_tokens=rng.choice([0, 3]), stop_token_ids=[rng.randrange(49152)])
    return params


def _random_workload(seed: int) -> list[tuple[str, list[int], dict[str, Any]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(60)]
    reqs = []
    for i in range(50):
        n = rng.choice([1, 3, 8, 20, 45, 90])
        prefix = shared[: rng.randrange(0, 60)] if rng.random() < 0.4 else []
        ids = (prefix + [rng.randrange(100, 40000) for _ in range(n)])[:120]
        reqs.append((f"r{i}", ids, _random_params(rng)))
    return reqs


@pytest.fixture(scope="module")
def stress_engine(make_engine: Any, sharp_llama_dir: str) -> Engine:
    return make_engine(
        sharp_llama_dir, max_total_tokens=260, chunked_prefill_size=16, max_running_requests=12
    )


@pytest.mark.parametrize("ratio", [scheduler_module.NEW_TOKEN_RATIO_INIT, 0.1])
def test_random_stress_with_aborts(
    stress_engine: Engine,
    sharp_engine: Engine,
    raw: Any,
    ratio: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_new_token_ratio(stress_engine.scheduler, ratio, monkeypatch)
    rng = random.Random(2024)
    workload = _random_workload(2024)
    to_abort = {rid for rid, _, _ in rng.sample(workload, 10)}
    retractions = count_retractions(stress_engine.scheduler)
    driver = raw(stress_engine)
    pending = list(workload)
    while pending or stress_engine.scheduler.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                driver.add(pending[0][0], pending[0][1], **pending[0][2])
                pending.pop(0)
        if rng.random() < 0.15 and to_abort & set(stress_engine.scheduler.reqs):
            driver.abort(rng.choice(sorted(to_abort & set(stress_engine.scheduler.reqs))))
        driver.step()
        check_live_ownership(stress_engine.scheduler)
    assert sum(retractions) > 0
    _check_stress_results(driver.results, workload, sharp_engine)


def check_live_ownership(sched: Scheduler) -> None:
    """Mid-run, each KV slot is free, owned by the tree, or owned by exactly one live request
    (its committed slots past the cache-protected prefix)."""
    live = sched.running + ([sched.chunked_req] if sched.chunked_req is not None else [])
    owned = [sched.allocator.free_slots(), sched.tree.all_slots()]
    for req in live:
        owned.append(
            sched.req_pool.req_to_token[
                req.req_pool_idx, req.cache_protected_len : req.kv_committed_len
            ]
        )
    slots = torch.cat(owned).sort().values
    assert torch.equal(slots, torch.arange(1, sched.allocator.size + 1)), "a KV slot leaked"
    assert all(r.req_pool_idx is None for r in sched.waiting), "a waiting request holds a row"


def _check_stress_results(
    results: dict[str, Any], workload: list[tuple[str, list[int], dict[str, Any]]], ref: Engine
) -> None:
    assert set(results) == {rid for rid, _, _ in workload}
    survivors = [(rid, ids, p) for rid, ids, p in workload if results[rid].finish.type != "abort"]
    assert len(survivors) >= 35
    for rid, _, p in survivors:
        res = results[rid]
        assert len(res.output_ids) == res.completion_tokens <= p["max_new_tokens"]
        if res.finish.type == "length":
            assert res.completion_tokens == p["max_new_tokens"]
    # greedy rows must match exactly; a seeded draw can land within float32 noise (~1e-7) of a
    # CDF step, so sampled rows only need the same finish
    greedy_rows = [(rid, ids, p) for rid, ids, p in survivors if p.get("temperature") == 0.0]
    assert len(greedy_rows) >= 10
    want = ref.generate(
        input_ids=[ids for _, ids, _ in greedy_rows], sampling_params=[p for _, _, p in greedy_rows]
    )
    for (rid, _, _), w in zip(greedy_rows, want, strict=True):
        assert results[rid].output_ids == w["output_ids"], rid
