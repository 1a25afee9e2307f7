"""One chat choice's generated text as OpenAI message fields: reasoning, content, tool calls.

The text goes through the server's reasoning parser first (`--reasoning-parser`, when set), and
the part that is the answer through the tool parser of the model's family (when the request
offers tools). Whole (`message`) and streamed (`ChoiceStream`) give the same fields: the
parsers guarantee that every chunking of a text splits it as the whole text splits.

Streamed deltas, OpenAI's shapes: `{"reasoning_content": ...}`, `{"content": ...}`, and per tool
call first `{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}]}`, then `{"tool_calls": [{"index", "function": {"arguments": ...}}]}`.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.server.reasoning_parser import REASONING_PARSERS, ReasoningParser
from sluice.server.tool_parser import PARSERS, ToolCall, ToolDelta, ToolParser
from sluice.tokenizer.chat import detect_parser, template_supports_tools

logger = logging.getLogger(__name__)

FALLBACK_TOOL_PARSER = "hermes"  # templates that do not render tools get sluice's hermes prompt


def resolve_tool_parser(setting: str, chat_template: str | None) -> str:
    """`--tool-call-parser`: a family, or auto (the family the chat template teaches, else the
    hermes format that sluice's fallback prompt asks for). A template that does not render
    tools in a format sluice knows gets that prompt, so its parser is hermes whatever is set."""
    if setting != "auto" and setting != FALLBACK_TOOL_PARSER:
        if not template_supports_tools(chat_template):
            logger.warning(
                "--tool-call-parser %s: the chat template does not render tools in that format; "
                "sluice's tool prompt asks for %s calls, so they are parsed as such",
                setting, FALLBACK_TOOL_PARSER,
            )  # fmt: skip
            return FALLBACK_TOOL_PARSER
    if setting != "auto":
        return setting
    name = detect_parser(chat_template) or FALLBACK_TOOL_PARSER
    logger.info("--tool-call-parser auto: %s", name)
    return name


class ChatParsers:
    """The parsers a chat request's choices use: reasoning (None when the server has none or
    the request turns thinking off) and tools (None when no tools are offered)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        max_calls: int | None = None,
    ) -> None:
        """`max_calls`: calls kept (1 with `parallel_tool_calls: false`), None: all."""
        self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls

    @classmethod
    def for_request(
        cls,
        reasoning_name: str | None,
        tool_name: str,
        tool_names: frozenset[str] | None,
        template_kwargs: Any,
        max_calls: int | None = None,
    ) -> ChatParsers:
        """`tool_names`: the functions the request offers, None when it offers none."""
        reasoning = None
        if reasoning_name is not None:
            reasoning = REASONING_PARSERS[reasoning_name].for_request(template_kwargs)
            reasoning = reasoning if reasoning.enabled else None
        tools = None if tool_names is None else PARSERS[tool_name](tool_names)
        return cls(reasoning, tools, max_calls)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a whole text, and whether it holds tool calls."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.parse(content)
            calls = calls[: self.max_calls]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["content"] = content or None
            msg["tool_calls"] = [_call_dict(c) for c in calls]
        return msg, bool(calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI deltas out."""

    def __init__(self, parsers: ChatParsers) -> None:
        self._reasoning = parsers.reasoning.stream() if parsers.reasoning else None
        self._tools = parsers.tools.stream() if parsers.tools else None
        self._max_calls = parsers.max_calls
        self.has_tool_calls = False

    def feed(self, delta: str) -> list[dict[str, Any]]:
        return self._deltas(delta, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """What the parsers held back (a partial tag or call), at the end of the output."""
        return self._deltas("", final=True)

    def _deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish() if final else self._reasoning.feed(text)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self._tools is None:
            if content:
                out.append({"content": content})
            return out
        if final:
            more, calls = self._tools.feed(content) if content else ("", [])
            rest, last = self._tools.finish()
            content, calls = more + rest, calls + last
        else:
            content, calls = self._tools.feed(content)
        if content:
            out.append({"content": content})
        if self._max_calls is not None:
            calls = [d for d in calls if d.index < self._max_calls]
        out.extend({"tool_calls": [_delta_dict(d)]} for d in calls)
        self.has_tool_calls = self.has_tool_calls or bool(calls)
        return out


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _delta_dict(d: ToolDelta) -> dict[str, Any]:
    if d.name is not None:  # the first delta of a call
        return {
            "index": d.index,
            "id": d.id,
            "type": "function",
            "function": {"name": d.name, "arguments": d.arguments},
        }
    return {"index": d.index, "function": {"arguments": d.arguments}}
