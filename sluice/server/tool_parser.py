"""Tool calls out of model text, whole (`ToolParser.parse`) or streamed (`ToolParser.stream`).

One parser per model family, registered in `PARSERS`:
- "hermes" (Hermes, Qwen2.5, Qwen3, and sluice's fallback prompt for templates without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, anywhere.
- "llama3" (Llama 3.1 / 3.2 JSON tool calls): `{"name": ..., "parameters": {...}}` as the whole
  output, or after `<|python_tag|>`; several are separated by `;`. Such a call has no marker of
  its own (a JSON answer may look like one), so only the functions the request offers are calls.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (an optional `[CALL_ID]id` before `[ARGS]` is skipped).

Guarantees, for every family:
- A call that does not parse (bad JSON, no string name, arguments not an object) stays in the
  content as the text it was; nothing is dropped and nothing raises.
- `arguments` is canonical: `json.dumps(parsed_arguments, ensure_ascii=False)`.
- Whitespace that only separates content from a call is dropped (so text made only of calls has
  content ""); all other text is kept as it was.
- Streaming gives the same result as `parse` for every split of the text into chunks: the
  content pieces (feed and finish) concatenate to `parse(text)[0]`, and per call index the first
  delta carries id, name and `arguments=""`, the next one the whole arguments string. Text that
  could still become a call (a partial marker, a call whose end has not arrived) is held back.
  `parse` is the stream fed the whole text at once, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

_ALNUM = string.ascii_letters + string.digits


def random_alnum(n: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ToolDelta:
    """One streamed piece of a tool call, OpenAI's shape."""

    index: int
    id: str | None = None  # only in the first delta of a call
    name: str | None = None  # only in the first delta of a call
    arguments: str = ""  # the call's arguments JSON, concatenated over its deltas


@dataclass
class _Found:
    """A call a scanner recognized, arguments already canonical."""

    name: str
    arguments: str


Event = str | _Found  # a scanner's output: content text, or a call


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """The JSON value of `text`, or None (NaN and Infinity are not JSON)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return None


def _call_from_obj(obj: Any, needs_args: bool = False) -> _Found | None:
    """A call out of `{"name": str, "arguments" | "parameters": object or its JSON text}`.
    `needs_args`: one of the two keys must be there (Llama 3's calls are bare JSON, so a JSON
    answer with a "name", e.g. a person, is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if needs_args and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    elif isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return _Found(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_tail(buf: str, start: int, marker: str) -> int:
    """Where the longest suffix of buf[start:] that is a proper prefix of `marker` begins."""
    for k in range(min(len(marker) - 1, len(buf) - start), 0, -1):
        if buf.endswith(marker[:k]):
            return len(buf) - k
    return len(buf)


_SIGNIFICANT = re.compile(r'["\\{}\[\]]')


class _JsonEnd:
    """Finds where the JSON object or array opening at `start` closes, resuming where the last
    look at the same `start` stopped (so a growing buffer is read once). Brackets are matched
    outside strings only; whether the text is valid JSON is left to json.loads."""

    def __init__(self) -> None:
        self.start = -1

    def find(self, buf: str, start: int) -> int | None:
        if start != self.start:
            self.start, self.i, self.depth, self.in_str = start, start, 0, False
        i, depth, in_str = self.i, self.depth, self.in_str
        while (m := _SIGNIFICANT.search(buf, i)) is not None:
            c, i = m.group(), m.end()
            if in_str:
                if c == "\\":
                    i += 1  # the escaped character, possibly not arrived yet
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.start = -1
                    return i
        self.i, self.depth, self.in_str = max(i, len(buf)), depth, in_str
        return None


class _Scanner:
    """Reads a growing buffer left to right from `pos`. `scan(buf, final)` returns the events
    decided since the last call and never one that more text could change; with `final` the
    text is complete and everything left is decided."""

    def __init__(self, names: frozenset[str] | None = None) -> None:
        """`names`: the functions the request offers (None: any name)."""
        self.pos = 0
        self.json_end = _JsonEnd()
        self.names = names

    def scan(self, buf: str, final: bool) -> list[Event]:
        raise NotImplementedError

    def content_until(self, buf: str, final: bool, marker: str, events: list[Event]) -> bool:
        """Emit content up to the next `marker` (holding a partial one back); True when the
        marker is found, with `pos` at it."""
        i = buf.find(marker, self.pos)
        end = i if i >= 0 else len(buf) if final else _partial_tail(buf, self.pos, marker)
        if end > self.pos:
            events.append(buf[self.pos : end])
            self.pos = end
        return i >= 0

    def json_value(self, buf: str, start: int, final: bool) -> tuple[bool, Any]:
        """(decided, value) of the JSON text opening at `start`; value None when invalid."""
        if start >= len(buf):
            return final, None
        if buf[start] not in "{[":
            return True, None
        end = self.json_end.find(buf, start)
        if end is None:
            return final, None
        return True, (end, _loads(buf[start:end]))


class _HermesScanner(_Scanner):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, buf: str, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.content_until(buf, final, self.OPEN, events):
            event = self._block(buf, final)
            if event is None:
                break
            events.append(event)
        return events

    def _block(self, buf: str, final: bool) -> Event | None:
        """The block opening at `pos`: a call, or its text when it is not one (a block that a
        new `<tool_call>` interrupts, or one whose JSON is not a call). None: not decided."""
        start, body = self.pos, self.pos + len(self.OPEN)
        after = body  # markers are looked for after the call's JSON (its strings may hold one)
        j = _skip(buf, body, " \t\r\n")
        if j < len(buf) and buf[j] == "{":
            end = self.json_end.find(buf, j)
            if end is None and not final:
                return None
            after = end if end is not None else body
        close, reopen = buf.find(self.CLOSE, after), buf.find(self.OPEN, after)
        if reopen >= 0 and (close < 0 or reopen < close):
            self.pos = reopen
            return buf[start:reopen]
        if close < 0 and not final:
            return None
        inner_end = close if close >= 0 else len(buf)
        self.pos = close + len(self.CLOSE) if close >= 0 else len(buf)
        return _call_from_obj(_loads(buf[body:inner_end])) or buf[start : self.pos]


def _skip(buf: str, i: int, chars: str) -> int:
    while i < len(buf) and buf[i] in chars:
        i += 1
    return i


class _Llama3Scanner(_Scanner):
    """Calls only at the start of the output or right after `<|python_tag|>`; after a call,
    `;` and whitespace separate the next one. Anything else is content from there on."""

    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str] | None = None) -> None:
        super().__init__(names)
        self.mode = "start"
        self.tag_pos = -1  # the tag that opened the calls, while no call has followed it

    def scan(self, buf: str, final: bool) -> list[Event]:
        events: list[Event] = []
        steps = {"start": self._start, "calls": self._calls, "content": self._content}
        while steps[self.mode](buf, final, events):
            pass
        return events

    def _start(self, buf: str, final: bool, events: list[Event]) -> bool:
        i = _skip(buf, self.pos, " \t\r\n")
        if not final and self.TAG.startswith(buf[i:]):
            return False  # only whitespace, or a partial tag, so far
        if i > self.pos:
            events.append(buf[self.pos : i])
            self.pos = i
        if buf.startswith(self.TAG, i):
            self.tag_pos, self.pos, self.mode = i, i + len(self.TAG), "calls"
        else:
            self.mode = "calls" if buf.startswith("{", i) else "content"
        return True

    def _calls(self, buf: str, final: bool, events: list[Event]) -> bool:
        j = _skip(buf, self.pos, " \t\r\n;")
        if j == len(buf) and (not final or self.tag_pos < 0):
            self.pos = j if final else self.pos  # separators that end the output are dropped
            return False
        decided, found = self.json_value(buf, j, final)
        if not decided:
            return False
        call = _call_from_obj(found[1], needs_args=True) if found else None
        if call is not None and self.names is not None and call.name not in self.names:
            call = None  # bare JSON that names no offered function is an answer, not a call
        if call is not None:
            events.append(call)
            self.pos, self.tag_pos = found[0], -1
            return True
        if self.tag_pos >= 0:  # the tag and what follows it are content
            events.append(self.TAG)
            self.pos, self.tag_pos = self.tag_pos + len(self.TAG), -1
        self.mode = "content"
        return True

    def _content(self, buf: str, final: bool, events: list[Event]) -> bool:
        if not self.content_until(buf, final, self.TAG, events):
            return False
        self.tag_pos, self.pos, self.mode = self.pos, self.pos + len(self.TAG), "calls"
        return True


_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class _MistralScanner(_Scanner):
    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def scan(self, buf: str, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.content_until(buf, final, self.MARK, events):
            decided, calls = self._after_mark(buf, self.pos + len(self.MARK), final)
            if not decided:
                break
            if calls is None:  # not a call: the marker is content, and reading goes on after it
                events.append(self.MARK)
                self.pos += len(self.MARK)
            else:
                events.extend(calls[1])
                self.pos = calls[0]
        return events

    def _after_mark(self, buf: str, i: int, final: bool) -> tuple[bool, Any]:
        """(decided, (end, calls) or None) for the text after a marker."""
        i = _skip(buf, i, " \t\r\n")
        if i < len(buf) and buf[i] == "[":
            decided, found = self.json_value(buf, i, final)
            if not decided or found is None or not isinstance(found[1], list) or not found[1]:
                return decided, None
            calls = [_call_from_obj(obj) for obj in found[1]]
            return True, None if None in calls else (found[0], calls)
        return self._named_call(buf, i, final)

    def _named_call(self, buf: str, i: int, final: bool) -> tuple[bool, Any]:
        """`name[ARGS]{...}`, with an optional `[CALL_ID]id` before `[ARGS]`."""
        name_end = _NAME.match(buf, i).end()
        j = name_end
        if buf.startswith(self.CALL_ID, j):
            j = _NAME.match(buf, j + len(self.CALL_ID)).end()
        rest = buf[j : j + len(self.ARGS)]
        if not rest.startswith(self.ARGS):
            waiting = (self.ARGS.startswith(rest) or self.CALL_ID.startswith(rest)) and not final
            return not waiting, None
        if name_end == i:
            return True, None
        decided, found = self.json_value(buf, j + len(self.ARGS), final)
        if not decided or found is None or not isinstance(found[1], dict):
            return decided, None
        call = _Found(buf[i:name_end], json.dumps(found[1], ensure_ascii=False))
        return True, (found[0], [call])


class ToolStream:
    """One generation's tool calls, fed as the text arrives (see the module docstring)."""

    def __init__(self, scanner: _Scanner, new_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_id = new_id
        self._buf = ""
        self._num_calls = 0
        self._held_ws = ""  # trailing content whitespace: dropped if a call follows
        self._after_call = False  # leading whitespace after a call is dropped

    def feed(self, delta: str) -> tuple[str, list[ToolDelta]]:
        self._buf += delta
        return self._emit(self._scanner.scan(self._buf, final=False))

    def finish(self) -> tuple[str, list[ToolDelta]]:
        content, deltas = self._emit(self._scanner.scan(self._buf, final=True))
        content, self._held_ws = content + self._held_ws, ""
        return content, deltas

    def _emit(self, events: list[Event]) -> tuple[str, list[ToolDelta]]:
        texts: list[str] = []
        deltas: list[ToolDelta] = []
        for event in events:
            if isinstance(event, str):
                texts.append(self._content(event))
                continue
            self._held_ws, self._after_call = "", True
            index, self._num_calls = self._num_calls, self._num_calls + 1
            deltas.append(ToolDelta(index, self._new_id(), event.name, ""))
            deltas.append(ToolDelta(index, arguments=event.arguments))
        return "".join(texts), deltas

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        return body


class ToolParser:
    """A family's parser for one request: `names` are the functions it offers (None: any);
    a family whose calls have no marker (llama3) takes only those as calls."""

    name: ClassVar[str]
    _scanner_type: ClassVar[type[_Scanner]]

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self.names = names

    def new_id(self) -> str:
        return "call_" + random_alnum(24)

    def stream(self) -> ToolStream:
        return ToolStream(self._scanner_type(self.names), self.new_id)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content left after removing the calls, the calls)."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        rest, more = stream.finish()
        return content + rest, calls_from_deltas(deltas + more)


def calls_from_deltas(deltas: list[ToolDelta]) -> list[ToolCall]:
    """The calls that a stream's deltas add up to, by index."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or "", d.name or "", "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


class HermesToolParser(ToolParser):
    name = "hermes"
    _scanner_type = _HermesScanner


class Llama3ToolParser(ToolParser):
    name = "llama3"
    _scanner_type = _Llama3Scanner


class MistralToolParser(ToolParser):
    name = "mistral"
    _scanner_type = _MistralScanner

    def new_id(self) -> str:
        return random_alnum(9)  # Mistral's templates accept exactly 9 alphanumerics


# the marker texts each family's calls are written with (they may be special tokens)
MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
}

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3ToolParser, MistralToolParser)
}
