"""Reasoning text (`<think>...</think>`) split from the answer, whole or streamed.

`ReasoningParser.parse(text)` returns `(reasoning_content, content)`:
- Reasoning opens with `start` at the beginning of the output (leading whitespace before it is
  dropped), or, with `starts_in_reasoning` (the chat template put `start` into the prompt), at
  the very beginning whether or not the model repeats `start`.
- It closes at the first `end`; newlines right after `end` are dropped, the rest is content.
- Reasoning that never closes: all of it is reasoning_content and content is "".
- No reasoning (not `starts_in_reasoning` and the output does not open with `start`, or the
  parser is disabled): reasoning_content is None and content is the text unchanged.
- Reasoning text itself is kept exactly as generated.

`stream()` gives the same split for every way of chunking the text: the reasoning deltas
(feed and finish) concatenate to parse's reasoning_content ("" where that is None), the content
deltas to its content. A partial tag at the end of a chunk is held back until it is known.

Registry `REASONING_PARSERS`: "deepseek-r1" (output starts inside reasoning) and "qwen3"
(output opens with `<think>`; `chat_template_kwargs={"enable_thinking": False}` means no
reasoning). `REASONING_PARSERS[name].for_request(chat_template_kwargs)` is the parser to use.
"""

from __future__ import annotations

from typing import Any


def _partial_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        starts_in_reasoning: bool = False,
        enabled: bool = True,
    ) -> None:
        self.start = start
        self.end = end
        self.starts_in_reasoning = starts_in_reasoning
        self.enabled = enabled

    @classmethod
    def for_request(cls, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningParser:
        """The parser for a request with these chat_template_kwargs."""
        return cls()

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None, content)."""
        if not self.enabled:
            return None, text
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text
        reasoning, sep, content = body.partition(self.end)
        return reasoning, content.lstrip("\r\n") if sep else ""

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One generation's split, fed as the text arrives. `has_reasoning` says whether the output
    has reasoning (parse's reasoning_content is not None), once that is known."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._p = parser
        self._buf = ""  # text not yet emitted: a possible partial tag or leading whitespace
        self._state = "open" if parser.enabled else "content"
        self.has_reasoning = False

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == "open" and not self._open(final):
                break
            if self._state == "reasoning" and not self._reason(final, reasoning):
                break
            if self._state == "closed":  # newlines right after the end tag are dropped
                self._buf = self._buf.lstrip("\r\n")
                if self._buf:
                    self._state = "content"
            if self._state == "content":
                content.append(self._buf)
                self._buf = ""
        if final and self._state == "open":  # empty output
            self.has_reasoning = self._p.starts_in_reasoning
        return "".join(reasoning), "".join(content)

    def _open(self, final: bool) -> bool:
        """Decide whether the output opens in reasoning; False: not decidable yet."""
        start = self._p.start
        body = self._buf.lstrip()
        if body.startswith(start):
            self._buf, self._state = body[len(start) :], "reasoning"
        elif start.startswith(body) and not final:
            return False
        else:
            self._state = "reasoning" if self._p.starts_in_reasoning else "content"
        self.has_reasoning = self._state == "reasoning"
        return True

    def _reason(self, final: bool, out: list[str]) -> bool:
        """Emit reasoning up to the end tag; True once the end tag is passed."""
        end = self._p.end
        i = self._buf.find(end)
        if i >= 0:
            out.append(self._buf[:i])
            self._buf, self._state = self._buf[i + len(end) :], "closed"
            return True
        keep = 0 if final else _partial_len(self._buf, end)
        out.append(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and templates like it) put `<think>` into the prompt."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"starts_in_reasoning": True, **kwargs})


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 opens its output with `<think>` when thinking; `enable_thinking: False` turns the
    reasoning off (the template then closes an empty think block in the prompt)."""

    @classmethod
    def for_request(cls, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningParser:
        thinking = (chat_template_kwargs or {}).get("enable_thinking", True)
        return cls(enabled=thinking is not False)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
