"""The pre-serialized frames of streamed text and content chunks are, byte for byte, the frames
`sse_data` makes of the same chunk as a dict."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.server.metrics import ServerMetrics
from sluice.server.serving_base import ResponseState, ServingContext
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.serving_completions import OpenAIServingCompletion
from sluice.server.sse import FrameTemplate, sse_data

TEXTS = [
    "",
    "plain",
    ' "quoted" ',
    "back\\slash \\n not a newline",
    "line\nbreak\r\ttab",
    "\x00\x01\x1f\x7f control",
    "ö é ß 你好 日本語",
    "🙂👍🏽 emoji, 𝔘",
    "\u2028\u2029 separators",
    "\ud800 lone surrogate",
    "</script>&<>'",
    "\ufdd0sluice-text\ufdd1",  # the template's own marker, as text
]


def _state(rid: str = "cmpl-abc", model: str = "m", include_usage: bool = False) -> ResponseState:
    metrics = ServerMetrics()
    return ResponseState(rid, model, 2, True, include_usage, metrics.track(), created=1700000000)


def _completion_dict(state: ResponseState, index: int, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": state.id, "object": "text_completion", "created": state.created,
        "model": state.model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    if state.include_usage:
        body["usage"] = None
    return body


def _chat_dict(state: ResponseState, index: int, content: str) -> dict[str, Any]:
    choice = {"index": index, "delta": {"content": content}, "logprobs": None}
    body: dict[str, Any] = {
        "id": state.id, "object": "chat.completion.chunk", "created": state.created,
        "model": state.model, "choices": [{**choice, "finish_reason": None}],
    }  # fmt: skip
    if state.include_usage:
        body["usage"] = None
    return body


def _servings() -> tuple[OpenAIServingCompletion, OpenAIServingChat]:
    ctx = ServingContext(None, "m", ServerMetrics(), None)  # type: ignore[arg-type]
    return OpenAIServingCompletion(ctx), OpenAIServingChat(ctx)


HEADS = [
    {},
    {"include_usage": True},
    {"rid": 'cmpl-"odd"\\id\n', "model": "módel 🙂/x"},
    {"rid": "cmpl-\ufdd0sluice-text\ufdd1"},  # the marker in the head: the dict path is taken
]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("index", [0, 3])
def test_completion_text_frames_are_the_dict_frames(head: dict, index: int) -> None:
    completions, _ = _servings()
    state = _state(**head)
    for text in TEXTS:
        frame = completions._chunk(state, index, text, None, None)
        assert frame == sse_data(_completion_dict(state, index, text)), repr(text)
        assert frame.startswith("data: ") and frame.endswith("\n\n")
    assert list(state.text_frames) == [index]  # one template per choice, made once


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("index", [0, 3])
def test_chat_content_frames_are_the_dict_frames(head: dict, index: int) -> None:
    _, chat = _servings()
    state = _state(**head)
    for text in TEXTS:
        frame = chat._chunk(state, index, {"content": text})
        assert frame == sse_data(_chat_dict(state, index, text)), repr(text)
    assert list(state.text_frames) == [index]


def test_the_rarer_chunks_keep_the_dict_path() -> None:
    completions, chat = _servings()
    state = _state(include_usage=True)
    logprobs = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": None}
    frame = completions._chunk(state, 1, "a", logprobs, None)
    expected = _completion_dict(state, 1, "a")
    expected["choices"][0]["logprobs"] = logprobs
    assert frame == sse_data(expected)
    frame = completions._chunk(state, 1, "", None, "stop", {"matched": 2})
    expected = _completion_dict(state, 1, "")
    expected["choices"][0] |= {"finish_reason": "stop", "matched_stop": 2}
    assert frame == sse_data(expected)
    for delta in ({"role": "assistant", "content": ""}, {"reasoning_content": "hm"}, {}):
        body = _chat_dict(state, 0, "")
        body["choices"][0]["delta"] = delta
        assert chat._chunk(state, 0, delta) == sse_data(body)
    body = _chat_dict(state, 0, "x")
    body["choices"][0] |= {"finish_reason": "length", "matched_stop": None}
    assert chat._chunk(state, 0, {"content": "x"}, reason="length") == sse_data(body)
    assert not state.text_frames  # none of those made a template


def test_a_template_decodes_as_its_body() -> None:
    template = FrameTemplate(lambda t: {"a": [1, {"t": t}], "b": None})
    for text in TEXTS:
        frame = template.frame(text)
        assert json.loads(frame[len("data: ") :]) == {"a": [1, {"t": text}], "b": None}
