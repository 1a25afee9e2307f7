"""The scheduler through the in-process Engine: shapes, counts, finish reasons, prefix cache,
chunked prefill, batching, scheduling policy, abort in every phase, and invalid input."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sluice.engine import Engine, parse_sampling_params
from sluice.messages import AbortReq, TokenizedGenerateReqInput
from sluice.model.forward_batch import ForwardMode

PROMPT = "The quick brown fox jumps over the lazy dog"
EOS = 2  # eos_token_id of the tiny models and of SmolLM2


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def long_ids(engine: Engine, num: int, seed_text: str = "Once upon a time") -> list[int]:
    """`num` token ids of natural text (so the default model has confident predictions)."""
    text = f"{seed_text}, in a small village by the sea, there lived an old fisherman. " * 20
    ids = engine.tokenizer.encode(text)
    assert len(ids) >= num
    return ids[:num]


# ---- basic generation ---------------------------------------------------------------------


def test_length_finish_and_token_counts(tiny_engine: Engine) -> None:
    out = tiny_engine.generate(PROMPT, greedy(7))
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length"}
    assert meta["prompt_tokens"] == len(tiny_engine.tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == len(out["output_ids"]) == 7
    assert out["text"] == tiny_engine.tokenizer.decode(out["output_ids"])


def test_single_and_list_return_shapes(tiny_engine: Engine) -> None:
    ids = tiny_engine.tokenizer.encode(PROMPT)
    single_text = tiny_engine.generate(PROMPT, greedy(2))
    single_ids = tiny_engine.generate(input_ids=ids, sampling_params=greedy(2))
    one_list = tiny_engine.generate([PROMPT], greedy(2))
    many = tiny_engine.generate([PROMPT, ids, "hi"], [greedy(1), greedy(2), greedy(3)])
    assert isinstance(single_text, dict) and isinstance(single_ids, dict)
    assert isinstance(one_list, list) and len(one_list) == 1
    assert [m["meta_info"]["completion_tokens"] for m in many] == [1, 2, 3]
    assert len({m["meta_info"]["id"] for m in many}) == 3


def test_text_and_input_ids_prompts_agree(sharp_engine: Engine) -> None:
    ids = sharp_engine.tokenizer.encode(PROMPT)
    by_text = sharp_engine.generate(PROMPT, greedy(12))
    by_ids = sharp_engine.generate(input_ids=[ids], sampling_params=greedy(12))[0]
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == by_ids["meta_info"]["prompt_tokens"]


def test_eos_stops_generation(tiny_engine: Engine) -> None:
    params = {"max_new_tokens": 10, "temperature": 0.0, "logit_bias": {EOS: 100.0}}
    out = tiny_engine.generate(PROMPT, params)
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["meta_info"]["completion_tokens"] == 1


def test_eos_stops_generation_on_the_default_model(default_engine: Engine) -> None:
    messages = [{"role": "user", "content": "Reply with just the word yes."}]
    prompt = default_engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    out = default_engine.generate(prompt, {"max_new_tokens": 32, "temperature": 0.0})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["output_ids"][-1] == EOS and EOS not in out["output_ids"][:-1]
    assert out["meta_info"]["completion_tokens"] < 32
    assert "<|im_end|>" not in out["text"]


# ---- prefix cache ---------------------------------------------------------------------------


def test_prefix_cache_reports_cached_tokens(sharp_engine: Engine) -> None:
    ids = long_ids(sharp_engine, 40, "A prefix-cache test")
    first = sharp_engine.generate(input_ids=ids, sampling_params=greedy(10))
    second = sharp_engine.generate(input_ids=ids, sampling_params=greedy(10))
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1
    assert second["output_ids"] == first["output_ids"]


def test_shared_prefix_is_reused(sharp_engine: Engine) -> None:
    ids = long_ids(sharp_engine, 30, "Shared prefix")
    sharp_engine.generate(input_ids=ids, sampling_params=greedy(1))
    out = sharp_engine.generate(input_ids=ids + [42, 43, 44], sampling_params=greedy(1))
    assert out["meta_info"]["cached_tokens"] == len(ids)


def test_identical_prompts_in_one_batch(sharp_engine: Engine) -> None:
    ids = long_ids(sharp_engine, 50, "Twins")
    outs = sharp_engine.generate(input_ids=[ids, ids, ids], sampling_params=greedy(8))
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == outs[2]["output_ids"]
    assert all(o["meta_info"]["cached_tokens"] < len(ids) for o in outs)


def test_disable_radix_cache_same_output(
    make_engine: Any, sharp_llama_dir: str, sharp_engine: Engine
) -> None:
    engine = make_engine(sharp_llama_dir, max_total_tokens=1024, disable_radix_cache=True)
    ids = long_ids(engine, 40, "No cache here")
    ref = sharp_engine.generate(input_ids=ids, sampling_params=greedy(10))
    outs = [engine.generate(input_ids=ids, sampling_params=greedy(10)) for _ in range(2)]
    for out in outs:
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["output_ids"] == ref["output_ids"]
    assert engine.scheduler.tree.total_size() == 0
    assert engine.scheduler.allocator.available_size() == 1024


# ---- chunked prefill ------------------------------------------------------------------------


def _count_extends(engine: Engine) -> list[int]:
    """Wrap the runner so every EXTEND forward records its token count."""
    sizes: list[int] = []
    forward = engine.scheduler.runner.forward

    def counting(fb: Any, **kwargs: Any) -> Any:
        if fb.mode == ForwardMode.EXTEND:
            sizes.append(int(fb.input_ids.numel()))
        return forward(fb, **kwargs)

    engine.scheduler.runner.forward = counting  # type: ignore[method-assign]
    return sizes


def test_chunked_prefill_matches_unchunked(make_engine: Any, default_engine: Engine) -> None:
    chunked = make_engine(None, max_total_tokens=1024, chunked_prefill_size=16)
    ids = long_ids(chunked, 100)
    kwargs = {"return_logprob": True, "logprob_start_len": 0}
    default_engine.scheduler.flush_cache()
    ref = default_engine.generate(input_ids=ids, sampling_params=greedy(8), **kwargs)
    sizes = _count_extends(chunked)
    out = chunked.generate(input_ids=ids, sampling_params=greedy(8), **kwargs)
    assert sizes == [16] * 6 + [4]
    assert out["output_ids"] == ref["output_ids"]
    got, want = out["meta_info"]["input_token_logprobs"], ref["meta_info"]["input_token_logprobs"]
    assert len(got) == len(want) == 100 and got[0] is None and want[0] is None
    assert max(abs(a - b) for a, b in zip(got[1:], want[1:], strict=True)) < 1e-4


def test_max_prefill_tokens_bounds_every_step_when_chunking(make_engine: Any) -> None:
    engine = make_engine(
        None, max_total_tokens=1024, chunked_prefill_size=16, max_prefill_tokens=12
    )
    sizes = _count_extends(engine)
    prompts = [long_ids(engine, 30, "First"), long_ids(engine, 10, "Second")]
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(2))
    assert all(o["meta_info"]["completion_tokens"] == 2 for o in outs)
    # the first prompt in chunks of 12, the second one after it, never more than 12 prompt
    # tokens a step; the first request decodes in the second's last step
    assert sizes == [12, 12, 6 + 6, 4 + 1]


def test_mixed_prefill_decodes_the_running_batch_in_the_same_forward(make_engine: Any) -> None:
    """While a long prompt is prefilled in chunks, the running request decodes in the same
    forwards, with the same tokens and logprobs as in separate steps."""
    outs, steps = {}, {}
    for disable in (False, True):
        engine = make_engine(
            None, max_total_tokens=1024, chunked_prefill_size=16, disable_mixed_prefill=disable
        )
        sizes = _count_extends(engine)
        prompts = [long_ids(engine, 10, "First"), long_ids(engine, 64, "Second")]
        outs[disable] = engine.generate(
            input_ids=prompts, sampling_params=[greedy(10), greedy(2)], return_logprob=True
        )
        steps[disable] = (sizes, engine.scheduler.num_forward_steps)
    # the first prompt with the second's first chunk, then three chunks each with a decode
    assert steps[False][0] == [10 + 6, 16 + 1, 16 + 1, 16 + 1, 10 + 1]
    assert steps[True][0] == [10 + 6, 16, 16, 16, 10]
    # 5 prefills, then the first request's 5 (mixed) or 9 (alone) tokens still to decode
    assert (steps[False][1], steps[True][1]) == (10, 14)
    for mixed, alone in zip(outs[False], outs[True], strict=True):
        assert mixed["output_ids"] == alone["output_ids"]
        got = mixed["meta_info"]["output_token_logprobs"]
        want = alone["meta_info"]["output_token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


# ---- batching and policy -------------------------------------------------------------------


def test_batch_equals_each_prompt_alone(default_engine: Engine) -> None:
    lengths = [3, 9, 17, 5, 30, 12, 24, 1]
    prompts = [long_ids(default_engine, n, f"Story {i}") for i, n in enumerate(lengths)]
    alone = [default_engine.generate(input_ids=p, sampling_params=greedy(24)) for p in prompts]
    default_engine.scheduler.flush_cache()
    batch = default_engine.generate(input_ids=prompts, sampling_params=greedy(24))
    assert [b["output_ids"] for b in batch] == [a["output_ids"] for a in alone]
    assert all(b["meta_info"]["completion_tokens"] == 24 for b in batch)


def _shared_prefix_prompts(engine: Engine) -> list[list[int]]:
    base = long_ids(engine, 24, "Policy")
    return [base[:n] + [100 + i, 200 + i] for i, n in enumerate([24, 6, 18, 12, 24, 3])]


def test_lpm_policy_gives_the_same_outputs(
    make_engine: Any, sharp_llama_dir: str, sharp_engine: Engine
) -> None:
    lpm = make_engine(sharp_llama_dir, max_total_tokens=1024, schedule_policy="lpm")
    prompts = _shared_prefix_prompts(lpm)
    want = sharp_engine.generate(input_ids=prompts, sampling_params=greedy(12))
    lpm.generate(input_ids=prompts[0], sampling_params=greedy(1))  # something to match
    got = lpm.generate(input_ids=prompts, sampling_params=greedy(12))
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_lpm_admits_the_longest_cached_prefix_first(
    make_engine: Any, sharp_llama_dir: str, raw: Any
) -> None:
    engine = make_engine(
        sharp_llama_dir, max_total_tokens=1024, schedule_policy="lpm", max_running_requests=1
    )
    cached = long_ids(engine, 20, "Cached")
    engine.generate(input_ids=cached, sampling_params=greedy(1))
    driver = raw(engine)
    driver.add("cold", [7, 8, 9, 10], **greedy(3))
    driver.add("warm", cached + [11], **greedy(3))
    driver.step()
    assert [r.rid for r in engine.scheduler.running] == ["warm"]
    driver.run()
    assert driver.results["warm"].cached_tokens == 20
    assert [driver.results[r].completion_tokens for r in ("cold", "warm")] == [3, 3]


def test_streaming_updates_add_up_to_the_full_output(sharp_engine: Engine, raw: Any) -> None:
    ids = long_ids(sharp_engine, 12, "Streaming")
    want = sharp_engine.generate(input_ids=ids, sampling_params=greedy(9))
    driver = raw(sharp_engine)
    driver.add("s", ids, stream=True, **greedy(9))
    driver.add("n", ids, stream=False, **greedy(9))
    driver.run()
    streamed, whole = driver.results["s"], driver.results["n"]
    assert streamed.updates == [[t] for t in want["output_ids"]]
    assert whole.updates == [want["output_ids"]]
    assert streamed.finish.type == whole.finish.type == "length"


# ---- abort ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chunk16_engine(make_engine: Any, sharp_llama_dir: str) -> Engine:
    return make_engine(
        sharp_llama_dir, max_total_tokens=1024, chunked_prefill_size=16, max_running_requests=2
    )


def _assert_aborted(result: Any, max_tokens: int) -> None:
    assert result.finish is not None and result.finish.type == "abort"
    assert result.finish.code == "request_aborted"
    assert len(result.output_ids) == result.completion_tokens < max_tokens


def test_abort_in_the_waiting_queue(chunk16_engine: Engine, raw: Any) -> None:
    driver = raw(chunk16_engine)
    for i, rid in enumerate(("a", "b", "c")):
        driver.add(rid, [5 + i, 6, 7, 8], **greedy(6))
    driver.step()  # a and b fill both request slots; c waits
    assert [r.rid for r in chunk16_engine.scheduler.waiting] == ["c"]
    chunk16_engine.abort("c")
    driver.run()
    _assert_aborted(driver.results["c"], 1)
    assert driver.results["a"].completion_tokens == driver.results["b"].completion_tokens == 6


def test_abort_mid_chunked_prefill(chunk16_engine: Engine, raw: Any) -> None:
    driver = raw(chunk16_engine)
    driver.add("long", long_ids(chunk16_engine, 100, "Chunky"), **greedy(6))
    driver.step()
    driver.step()
    sched = chunk16_engine.scheduler
    assert sched.chunked_req is not None and sched.chunked_req.kv_committed_len == 32
    driver.abort("long")
    driver.run()
    _assert_aborted(driver.results["long"], 1)
    assert sched.chunked_req is None


def test_abort_mid_decode(chunk16_engine: Engine, raw: Any) -> None:
    driver = raw(chunk16_engine)
    driver.add("dec", [11, 12, 13], **greedy(50))
    driver.add("other", [14, 15], **greedy(10))
    sched = chunk16_engine.scheduler
    while len(sched.reqs["dec"].output_ids) < 4:
        driver.step()
    driver.abort("dec")
    driver.run()
    _assert_aborted(driver.results["dec"], 50)
    assert driver.results["dec"].completion_tokens >= 4
    assert driver.results["other"].completion_tokens == 10


def test_abort_all(chunk16_engine: Engine, raw: Any) -> None:
    driver = raw(chunk16_engine)
    driver.add("x", long_ids(chunk16_engine, 60, "Abort all"), **greedy(20))
    driver.add("y", [21, 22, 23], **greedy(20))
    driver.add("z", [24, 25], **greedy(20))
    for _ in range(3):
        driver.step()
    chunk16_engine.scheduler.abort(AbortReq(abort_all=True))
    driver.run()
    assert {rid: r.finish.type for rid, r in driver.results.items()} == dict.fromkeys(
        "xyz", "abort"
    )


def test_an_abort_from_another_worker_leaves_the_request_alone(
    chunk16_engine: Engine, raw: Any
) -> None:
    """Two HTTP workers may send the same client rid; the scheduler refuses the second, and
    that worker's abort of "its" rid (its client gone) must not end the first worker's."""
    driver = raw(chunk16_engine)
    driver.add("r", [11, 12, 13], reply_to="ipc://w0", **greedy(8))
    driver.step()
    chunk16_engine.scheduler.abort(AbortReq(rid="r", reply_to="ipc://w1"))
    driver.run()
    assert driver.results["r"].finish.type == "length"
    driver.add("s", [11, 12, 13], reply_to="ipc://w0", **greedy(8))
    driver.step()
    chunk16_engine.scheduler.abort(AbortReq(rid="s", reply_to="ipc://w0"))  # its own worker
    driver.run()
    _assert_aborted(driver.results["s"], 8)


def test_abort_of_unknown_or_finished_rid_is_harmless(chunk16_engine: Engine, raw: Any) -> None:
    driver = raw(chunk16_engine)
    driver.add("done", [1, 2, 3], **greedy(2))
    driver.run()
    driver.abort("done")
    driver.abort("never-seen")
    driver.run()
    assert driver.results["done"].finish.type == "length"
    out = chunk16_engine.generate(PROMPT, greedy(3))
    assert out["meta_info"]["completion_tokens"] == 3


# ---- invalid input --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool_engine(make_engine: Any, tiny_llama_dir: str) -> Engine:
    """Context 512 (the tiny model's), KV pool 256."""
    return make_engine(tiny_llama_dir, max_total_tokens=256)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", greedy(4), "empty"),
        ([1, 2, 49152], greedy(4), "token ids must be in [0, 49152)"),
        ([1, -1, 2], greedy(4), "token ids must be in [0, 49152)"),
        ([3] * 600, greedy(4), "maximum context length is 512"),
        ([3] * 600, {"temperature": 0.0}, "maximum context length is 512"),
        ([3] * 10, greedy(400), "the request needs 410 KV slots but the KV pool holds 256"),
    ],
    ids=["empty", "id-over-vocab", "negative-id", "over-context", "over-context-no-max", "pool"],
)
def test_invalid_input_aborts_and_the_engine_keeps_working(
    small_pool_engine: Engine, prompt: Any, params: dict[str, Any], message: str
) -> None:
    out = small_pool_engine.generate([prompt, PROMPT], [params, greedy(3)])
    reason = out[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert message in reason["message"]
    assert out[0]["output_ids"] == [] and out[0]["meta_info"]["completion_tokens"] == 0
    assert out[1]["meta_info"]["completion_tokens"] == 3


def test_duplicate_rid_is_rejected(small_pool_engine: Engine, raw: Any) -> None:
    sched = small_pool_engine.scheduler
    driver = raw(small_pool_engine)
    driver.add("twin", [1, 2, 3], **greedy(5))
    driver.step()
    params = parse_sampling_params(greedy(2))
    sched.add_request(
        TokenizedGenerateReqInput(rid="twin", input_ids=[4, 5], sampling_params=params)
    )
    rejected = sched._take_outputs()
    assert rejected is not None and rejected.rids == ["twin"]
    assert rejected.finished_reasons[0].type == "abort"
    assert "already running" in rejected.finished_reasons[0].message
    assert "twin" in sched.reqs  # the first one lives on
    driver.run()
    assert driver.results["twin"].completion_tokens == 5


def test_default_max_new_tokens_fits_a_pool_smaller_than_the_context(
    small_pool_engine: Engine,
) -> None:
    out = small_pool_engine.generate([5, 6, 7], {"temperature": 0.0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert 0 < out["meta_info"]["completion_tokens"] <= 256 - 3


def test_unknown_sampling_params_are_an_error() -> None:
    with pytest.raises((ValueError, msgspec.ValidationError)):
        parse_sampling_params({"max_tokens": 5})


def test_wrongly_typed_sampling_params_are_an_error() -> None:
    with pytest.raises((ValueError, msgspec.ValidationError)):
        parse_sampling_params({"temperature": "hot"})


def test_context_length_over_the_model_limit_never_crashes(tiny_llama_dir: str) -> None:
    try:
        engine = Engine(tiny_llama_dir, context_length=1024, max_total_tokens=2048, num_threads=1)
    except ValueError:
        return  # refusing the setting at start-up is a fix too
    out = engine.generate(input_ids=[5] * 600, sampling_params=greedy(4))
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "abort")
