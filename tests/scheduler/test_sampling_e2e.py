"""Sampling parameters end to end through the Engine: seeds, stops, min/ignore EOS, logprobs.

Runs on the sharp tiny llama (peaked logits), so seeded draws do not flip on float32 noise
between batch shapes.
"""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine import Engine

EOS = 2
PROMPT = "Tell me a story about a dragon"
SEEDED = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 42, "ignore_eos": True}


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


# ---- seeds and determinism ------------------------------------------------------------------


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(sharp_engine: Engine) -> None:
    alone = sharp_engine.generate(PROMPT, SEEDED)
    others = [
        {"max_new_tokens": 9, "temperature": 1.0, "top_k": 5, "ignore_eos": True},
        greedy(20),
        {"max_new_tokens": 16, "temperature": 1.3, "seed": 7, "repetition_penalty": 1.3},
        {"max_new_tokens": 12, "temperature": 0.6, "min_p": 0.1, "frequency_penalty": 0.5},
    ]
    prompts = ["Once upon a time", "x", PROMPT, "The weather today is", "1 2 3 4 5"]
    batch = sharp_engine.generate(prompts, [others[0], others[1], SEEDED, others[2], others[3]])
    assert batch[2]["output_ids"] == alone["output_ids"]
    assert len(alone["output_ids"]) == 16


def test_seeded_sampling_is_not_greedy_and_seeds_differ(sharp_engine: Engine) -> None:
    outs = [
        sharp_engine.generate(PROMPT, {**SEEDED, "seed": seed})["output_ids"] for seed in (1, 2, 42)
    ]
    greedy_ids = sharp_engine.generate(PROMPT, greedy(16))["output_ids"]
    assert len({tuple(o) for o in outs}) == 3
    assert greedy_ids not in outs


def test_temperature_zero_is_deterministic_argmax(sharp_engine: Engine) -> None:
    kwargs = {"return_logprob": True, "top_logprobs_num": 1}
    first = sharp_engine.generate(PROMPT, greedy(12), **kwargs)
    second = sharp_engine.generate(PROMPT, greedy(12), **kwargs)
    assert first["output_ids"] == second["output_ids"]
    tops = first["meta_info"]["output_top_logprobs"]
    assert [t[0][0] for t in tops] == first["output_ids"]


# ---- stops ----------------------------------------------------------------------------------


def _stop_string_in(engine: Engine, output_ids: list[int], num_tokens: int) -> str:
    """The text of `num_tokens` output tokens (past the first few): a good stop string."""
    for k in range(3, len(output_ids) - num_tokens):
        piece = engine.tokenizer.decode(output_ids[k : k + num_tokens]).strip()
        if len(piece) >= 3 * num_tokens and piece.isprintable():
            return piece
    pytest.fail("no usable stop string in the greedy output")


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_stop_strings_end_generation_and_are_trimmed(sharp_engine: Engine, num_tokens: int) -> None:
    full = sharp_engine.generate(PROMPT, greedy(24))
    stop = _stop_string_in(sharp_engine, full["output_ids"], num_tokens)
    cut = full["text"].index(stop)
    out = sharp_engine.generate(PROMPT, greedy(24, stop=stop))
    kept = sharp_engine.generate(PROMPT, greedy(24, stop=[stop, "@@never@@"], no_stop_trim=True))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full["text"][:cut]
    assert kept["text"] == full["text"][: cut + len(stop)]
    n = out["meta_info"]["completion_tokens"]
    assert n < 24 and out["output_ids"] == full["output_ids"][:n]
    assert stop in sharp_engine.tokenizer.decode(out["output_ids"])
    assert stop not in sharp_engine.tokenizer.decode(out["output_ids"][:-1])


def test_stop_string_in_the_prompt_does_not_stop(sharp_engine: Engine) -> None:
    out = sharp_engine.generate(PROMPT, greedy(6, stop=["dragon"]))
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ids(sharp_engine: Engine) -> None:
    full = sharp_engine.generate(PROMPT, greedy(20))["output_ids"]
    stop_id = full[5]
    first = full.index(stop_id)
    out = sharp_engine.generate(PROMPT, greedy(20, stop_token_ids=[stop_id]))
    assert out["output_ids"] == full[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_min_new_tokens_holds_off_eos(sharp_engine: Engine) -> None:
    eager = {"max_new_tokens": 20, "temperature": 0.0, "logit_bias": {EOS: 50.0}}
    plain = sharp_engine.generate(PROMPT, eager)
    held = sharp_engine.generate(PROMPT, {**eager, "min_new_tokens": 5})
    assert plain["output_ids"] == [EOS]
    assert held["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert held["meta_info"]["completion_tokens"] == 6
    assert EOS not in held["output_ids"][:5] and held["output_ids"][5] == EOS


def test_ignore_eos_keeps_going(sharp_engine: Engine) -> None:
    params = {"max_new_tokens": 5, "temperature": 0.0, "logit_bias": {EOS: 50.0}}
    out = sharp_engine.generate(PROMPT, {**params, "ignore_eos": True})
    assert out["output_ids"] == [EOS] * 5
    assert out["meta_info"]["finish_reason"] == {"type": "length"}


# ---- logprobs -------------------------------------------------------------------------------


def test_output_logprobs(sharp_engine: Engine) -> None:
    params = {"max_new_tokens": 10, "temperature": 0.9, "seed": 3, "ignore_eos": True}
    out = sharp_engine.generate(PROMPT, params, return_logprob=True, top_logprobs_num=4)
    meta = out["meta_info"]
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(lps) == len(tops) == meta["completion_tokens"] == 10
    assert all(lp <= 0.0 for lp in lps)
    for lp, (ids, values), tok in zip(lps, tops, out["output_ids"], strict=True):
        assert len(ids) == len(values) == 4
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert lp <= values[0] + 1e-6
        if tok in ids:
            assert lp == pytest.approx(values[ids.index(tok)], abs=1e-5)


def test_input_logprobs_from_the_start(sharp_engine: Engine) -> None:
    out = sharp_engine.generate(
        PROMPT, greedy(3), return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    meta = out["meta_info"]
    n = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"]) == n
    assert meta["input_token_logprobs"][0] is None and meta["input_top_logprobs"][0] is None
    assert all(lp <= 0.0 for lp in meta["input_token_logprobs"][1:])
    assert len(meta["output_token_logprobs"]) == 3


def test_input_logprobs_from_an_offset_after_a_cache_hit(sharp_engine: Engine) -> None:
    ids = sharp_engine.tokenizer.encode(PROMPT + " and a knight")
    full = sharp_engine.generate(
        input_ids=ids, sampling_params=greedy(1), return_logprob=True, logprob_start_len=0
    )
    part = sharp_engine.generate(
        input_ids=ids, sampling_params=greedy(1), return_logprob=True, logprob_start_len=4
    )
    want = full["meta_info"]["input_token_logprobs"][4:]
    got = part["meta_info"]["input_token_logprobs"]
    assert len(got) == len(ids) - 4
    assert got == pytest.approx(want, abs=1e-4)
    assert part["meta_info"]["cached_tokens"] == 3


def test_max_new_tokens_zero_returns_only_input_logprobs(sharp_engine: Engine) -> None:
    out = sharp_engine.generate(
        PROMPT, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length"}
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert "output_token_logprobs" not in meta


def test_output_logprobs_match_input_logprobs_of_the_continuation(sharp_engine: Engine) -> None:
    """A generated token's logprob (decode path) equals its logprob as a prompt token (prefill)."""
    ids = sharp_engine.tokenizer.encode(PROMPT)
    gen = sharp_engine.generate(
        input_ids=ids, sampling_params={**SEEDED, "max_new_tokens": 8}, return_logprob=True
    )
    replay = sharp_engine.generate(
        input_ids=ids + gen["output_ids"], sampling_params={"max_new_tokens": 0},
        return_logprob=True, logprob_start_len=len(ids),
    )  # fmt: skip
    got = replay["meta_info"]["input_token_logprobs"]
    assert got == pytest.approx(gen["meta_info"]["output_token_logprobs"], abs=1e-4)
