"""A failing forward ends only the requests of its batch, with a 500, and leaks nothing."""

from __future__ import annotations

from typing import Any

import pytest

from sluice import Engine
from sluice.model.forward_batch import ForwardMode


def test_forward_exception_aborts_the_batch_and_the_engine_keeps_serving(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_engine.scheduler.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def failing_forward(fb, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # fail a decode step, after slots were allocated for it
            raise RuntimeError("injected fault")
        return real_forward(fb, **kwargs)

    monkeypatch.setattr(runner, "forward", failing_forward)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs = tiny_engine.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=params)
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert reason["status_code"] == 500
        assert "injected fault" in reason["message"]
    tiny_engine.scheduler.check_idle_invariant()
    monkeypatch.setattr(runner, "forward", real_forward)
    again = tiny_engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert again["meta_info"]["completion_tokens"] == 8


def test_context_length_beyond_the_model_is_refused_at_start(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="exceeds the model's maximum of 512"):
        Engine(tiny_llama_dir, context_length=1024, max_total_tokens=2048, num_threads=1)


def test_non_finite_logits_end_only_that_request(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_engine.scheduler.runner
    real_forward = runner.forward
    poisoned = {"first": True}

    def nan_for_one_row(fb, **kwargs):
        logits = real_forward(fb, **kwargs)
        if poisoned["first"] and logits.shape[0] == 2:
            poisoned["first"] = False
            logits = logits.clone()  # an inference tensor: modify a copy
            logits[1] = float("nan")  # the second request of the first two-row batch
        return logits

    monkeypatch.setattr(runner, "forward", nan_for_one_row)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    ok, bad = tiny_engine.generate(input_ids=[[5, 6, 7], [8, 9, 10, 11]], sampling_params=params)
    assert ok["meta_info"]["completion_tokens"] == 6
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert bad["meta_info"]["finish_reason"]["status_code"] == 500
    assert "non-finite" in bad["meta_info"]["finish_reason"]["message"]
    tiny_engine.scheduler.check_idle_invariant()


def test_a_failing_mixed_step_ends_its_prompts_and_spares_the_decoding_requests(
    make_engine: Any, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second prompt's chunk fails in a forward where the first request decodes: the
    prompt ends with a 500, the first request decodes on to its length."""
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=4)
    runner = engine.scheduler.runner
    real_forward = runner.forward
    extends = {"n": 0}

    def failing_forward(fb, **kwargs):
        if fb.mode == ForwardMode.EXTEND:
            extends["n"] += 1
            if extends["n"] == 2:  # the second chunk, with the first request's decode
                raise RuntimeError("injected fault")
        return real_forward(fb, **kwargs)

    monkeypatch.setattr(runner, "forward", failing_forward)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    first, second = engine.generate(
        input_ids=[[5, 6, 7], list(range(20, 30))], sampling_params=params
    )
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    assert first["meta_info"]["completion_tokens"] == 8
    reason = second["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    engine.scheduler.check_idle_invariant()
