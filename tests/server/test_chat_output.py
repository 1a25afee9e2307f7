"""Chat choices as OpenAI message fields: reasoning first, then content and tool calls; whole
and streamed give the same fields; `parallel_tool_calls: false` keeps the first call only."""

from __future__ import annotations

import json

from sluice.server.chat_output import ChatParsers
from sluice.server.reasoning_parser import REASONING_PARSERS
from sluice.server.tool_parser import PARSERS

TWO_CALLS = (
    "<think>plan it</think>\n"
    'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
)


def _parsers(max_calls: int | None = None) -> ChatParsers:
    return ChatParsers(REASONING_PARSERS["qwen3"](), PARSERS["hermes"](), max_calls)


def _streamed(parsers: ChatParsers, text: str, step: int) -> dict:
    stream = parsers.stream()
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i : i + step])
    deltas += stream.finish()
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call["function"]["arguments"]
    return {
        "reasoning": "".join(d.get("reasoning_content", "") for d in deltas),
        "content": "".join(d.get("content", "") for d in deltas),
        "calls": [calls[i] for i in sorted(calls)],
        "has_calls": stream.has_tool_calls,
    }


def test_reasoning_content_and_calls_whole_and_streamed_agree() -> None:
    message, has_calls = _parsers().message(TWO_CALLS)
    assert has_calls and message["reasoning_content"] == "plan it"
    assert message["content"] == "Sure."
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert names == ["f", "g"] and json.loads(
        message["tool_calls"][0]["function"]["arguments"]
    ) == {"a": 1}
    for step in (1, 3, 7, len(TWO_CALLS)):
        streamed = _streamed(_parsers(), TWO_CALLS, step)
        assert streamed["reasoning"] == "plan it" and streamed["content"] == "Sure."
        assert [c["name"] for c in streamed["calls"]] == ["f", "g"]
        assert [c["arguments"] for c in streamed["calls"]] == [
            c["function"]["arguments"] for c in message["tool_calls"]
        ]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    message, _ = _parsers(max_calls=1).message(TWO_CALLS)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    streamed = _streamed(_parsers(max_calls=1), TWO_CALLS, 5)
    assert [c["name"] for c in streamed["calls"]] == ["f"] and streamed["has_calls"]


def test_no_calls_means_content_and_no_tool_calls_field() -> None:
    message, has_calls = _parsers().message("just text")
    assert not has_calls and message == {
        "role": "assistant",
        "content": "just text",
        "reasoning_content": None,
    }
