"""DetokenizerManager: per-rid state lifetime, per-request flags, pass-through fields."""

from __future__ import annotations

from typing import Any

from sluice.detokenizer.incremental import byte_level_pieces
from sluice.detokenizer.manager import DetokenizerManager
from sluice.messages import BatchTokenIDOutput, FinishReason, TopLogprobs

LENGTH = FinishReason(type="length")


def batch(items: list[dict[str, Any]]) -> BatchTokenIDOutput:
    """A scheduler update; each item needs `rid` and `ids`, other fields have defaults."""
    return BatchTokenIDOutput(
        rids=[it["rid"] for it in items],
        new_token_ids=[it["ids"] for it in items],
        finished_reasons=[it.get("finish") for it in items],
        prompt_tokens=[it.get("prompt_tokens", 5) for it in items],
        completion_tokens=[it.get("completion_tokens", len(it["ids"])) for it in items],
        cached_tokens=[it.get("cached_tokens", 0) for it in items],
        skip_special_tokens=[it.get("skip", True) for it in items],
        spaces_between_special_tokens=[True for _ in items],
        stop_strings=[it.get("stop", []) for it in items],
        no_stop_trim=[it.get("no_stop_trim", False) for it in items],
        output_token_logprobs=[it.get("logprobs", []) for it in items],
        output_top_logprobs=[it.get("top_logprobs", []) for it in items],
        input_token_logprobs=[it.get("input_logprobs", []) for it in items],
        input_top_logprobs=[[] for _ in items],
        reply_to=[it.get("owner", "ipc://tm0") for it in items],
    )


def run_interleaved(manager: DetokenizerManager, streams: dict[str, list[int]], **kw):
    """Feeds every rid one token per update, all rids in each update; returns texts per rid."""
    texts = dict.fromkeys(streams, "")
    for step in range(max(len(ids) for ids in streams.values())):
        items = []
        for rid, ids in streams.items():
            if step < len(ids):
                finish = LENGTH if step == len(ids) - 1 else None
                items.append({"rid": rid, "ids": [ids[step]], "finish": finish, **kw.get(rid, {})})
        out = manager.handle(batch(items))
        for rid, text in zip(out.rids, out.texts, strict=True):
            texts[rid] += text
    return texts


def test_interleaved_requests_and_state_freed_on_finish(tokenizer):
    manager = DetokenizerManager(tokenizer)
    streams = {
        "a": tokenizer.encode("Hello 世界 🎉 and more text", add_special_tokens=False),
        "b": tokenizer.encode("สวัสดี", add_special_tokens=False),
    }
    texts = run_interleaved(manager, streams)
    assert texts == {"a": "Hello 世界 🎉 and more text", "b": "สวัสดี"}
    assert manager.num_states() == 0


def test_states_on_byte_level_pieces_and_on_windows_give_the_same_texts(tokenizer):
    """The process hands the manager the tokenizer's byte-level pieces (both ways of skipping
    special tokens); without them its states decode windows of ids. A request that keeps its
    special tokens and one that skips them, interleaved: the same texts either way."""
    pieces = {skip: byte_level_pieces(tokenizer, skip) for skip in (True, False)}
    assert all(p is not None for p in pieces.values())
    streams = {
        "a": tokenizer.encode("<|im_start|>Hi 🎉 there<|im_end|>", add_special_tokens=False),
        "b": tokenizer.encode("<|im_start|>สวัสดี 世界<|im_end|>", add_special_tokens=False),
    }
    kw = {"b": {"skip": False}}
    fast = run_interleaved(DetokenizerManager(tokenizer, pieces), streams, **kw)
    windows = run_interleaved(
        DetokenizerManager(tokenizer, {True: None, False: None}), streams, **kw
    )
    assert fast == windows == {"a": "Hi 🎉 there", "b": "<|im_start|>สวัสดี 世界<|im_end|>"}


def test_state_lives_until_finish_or_abort(tokenizer):
    manager = DetokenizerManager(tokenizer)
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    manager.handle(batch([{"rid": "x", "ids": ids[:1]}, {"rid": "y", "ids": ids[:1]}]))
    assert manager.num_states() == 2
    manager.abort("x", "ipc://tm1")  # another worker's request of that rid: not this one
    assert manager.num_states() == 2
    manager.abort("x", "ipc://tm0")
    manager.abort("unknown", "ipc://tm0")
    assert manager.num_states() == 1
    out = manager.handle(batch([{"rid": "y", "ids": ids[1:], "finish": LENGTH}]))
    assert out.texts == [" two three"]
    assert manager.num_states() == 0


def test_per_request_flags_and_stop_strings(tokenizer):
    manager = DetokenizerManager(tokenizer)
    ids = tokenizer.encode("Hi<|im_end|> the END here", add_special_tokens=False)
    texts = run_interleaved(
        manager,
        {"keep": ids, "skip": ids, "stop": ids, "stop_kept": ids},
        keep={"skip": False},
        stop={"stop": ["END"]},
        stop_kept={"stop": ["END"], "no_stop_trim": True},
    )
    assert texts == {
        "keep": "Hi<|im_end|> the END here",
        "skip": "Hi the END here",
        "stop": "Hi the ",
        "stop_kept": "Hi the END",
    }
    assert manager.num_states() == 0


def test_fields_pass_through_unchanged(tokenizer):
    manager = DetokenizerManager(tokenizer)
    top = [TopLogprobs(token_ids=[1, 2], logprobs=[-0.1, -2.0])]
    finish = FinishReason(type="stop", matched=2)
    item = {
        "rid": "r",
        "ids": tokenizer.encode("ok", add_special_tokens=False) + [2],
        "finish": finish,
        "prompt_tokens": 11,
        "completion_tokens": 3,
        "cached_tokens": 7,
        "logprobs": [-0.5, -0.25, -0.125],
        "top_logprobs": top * 3,
        "input_logprobs": [None, -1.5],
    }
    src = batch([item])
    out = manager.handle(src)
    assert out.rids == ["r"]
    assert out.texts == ["ok"]
    assert out.new_token_ids == src.new_token_ids
    assert out.finished_reasons == [finish]
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == ([11], [3], [7])
    assert out.output_token_logprobs == [[-0.5, -0.25, -0.125]]
    assert out.output_top_logprobs == [top * 3]
    assert out.input_token_logprobs == [[None, -1.5]]
    assert out.input_top_logprobs == [[]]


def test_empty_batch(tokenizer):
    out = DetokenizerManager(tokenizer).handle(batch([]))
    assert out.rids == [] and out.texts == []


def test_two_owners_of_one_rid_keep_their_own_state(tokenizer):
    """Two HTTP workers' requests may carry the same client rid: the scheduler refuses the
    second, and its refusal must not end (or take the text of) the first's state."""
    manager = DetokenizerManager(tokenizer)
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    manager.handle(batch([{"rid": "r", "ids": ids[:1], "owner": "ipc://tm0"}]))
    refused = manager.handle(
        batch([{"rid": "r", "ids": [], "finish": LENGTH, "owner": "ipc://tm1"}])
    )
    assert refused.texts == [""] and manager.num_states() == 1
    out = manager.handle(
        batch([{"rid": "r", "ids": ids[1:], "finish": LENGTH, "owner": "ipc://tm0"}])
    )
    assert out.texts == [tokenizer.decode(ids)[len(tokenizer.decode(ids[:1])) :]]
    assert manager.num_states() == 0
