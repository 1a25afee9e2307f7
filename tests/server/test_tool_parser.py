"""Tool-call parsers: canned outputs per family, and streaming equal to parse for every chunking."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.server.tool_parser import PARSERS, ToolDelta, ToolParser
from sluice.tokenizer.chat import detect_parser

ARGS = {"city": 'Pa"ris', "nested": {"list": [1, {"k": "ü 😀 \\ \n"}], "none": None}}
ARGS_JSON = json.dumps(ARGS, ensure_ascii=False)


def hermes_call(name: str, args: object, ascii: bool = False) -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=ascii)
    return f"<tool_call>\n{body}\n</tool_call>"


def llama3_call(name: str, args: object, ascii: bool = False) -> str:
    return json.dumps({"name": name, "parameters": args}, ensure_ascii=ascii)


def mistral_call(name: str, args: object, ascii: bool = False) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args, ensure_ascii=ascii)}"


def stream_all(parser: ToolParser, chunks: list[str]) -> tuple[str, list[ToolDelta]]:
    stream = parser.stream()
    content, deltas = [], []
    for chunk in chunks:
        text, more = stream.feed(chunk)
        content.append(text)
        deltas += more
    text, more = stream.finish()
    return "".join(content) + text, deltas + more


def assert_stream_matches_parse(parser: ToolParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    content, calls = parser.parse(text)
    streamed, deltas = stream_all(parser, chunks)
    assert streamed == content
    by_index: dict[int, list[ToolDelta]] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    assert list(by_index) == list(range(len(calls)))  # indexes in order, calls contiguous
    for i, call in enumerate(calls):
        first, *rest = by_index[i]
        assert first.id and first.name == call.name and first.arguments == ""
        assert all(d.id is None and d.name is None for d in rest)
        args = "".join(d.arguments for d in rest)
        assert args == call.arguments
        assert isinstance(json.loads(args), dict)


def chunked(text: str, cuts: set[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def calls_of(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parser.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


# --- canned outputs -------------------------------------------------------------------------

CANNED = {
    "hermes": [
        (hermes_call("f", {"a": 1}), "", [("f", {"a": 1})]),
        # a closing tag inside an argument string does not end the call
        (
            hermes_call("f", {"s": "a</tool_call>b<tool_call>"}),
            "",
            [("f", {"s": "a</tool_call>b<tool_call>"})],
        ),
        (
            hermes_call("f", {}) + "\n" + hermes_call("g", {"b": 2}),
            "",
            [("f", {}), ("g", {"b": 2})],
        ),
        ("Let me look.\n\n" + hermes_call("f", {"a": 1}), "Let me look.", [("f", {"a": 1})]),
        ("Just text, <tool_ish> and {}.\n", "Just text, <tool_ish> and {}.\n", []),
        (
            "<tool_call>\n{not json}\n</tool_call> ok",
            "<tool_call>\n{not json}\n</tool_call> ok",
            [],
        ),
        ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
        (hermes_call("f", ARGS, ascii=True), "", [("f", ARGS)]),
        (hermes_call("f", ARGS) + "\nDone.", "Done.", [("f", ARGS)]),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            "",
            [("f", {"a": 1})],
        ),
        ('<tool_call>\n{"name": "f", "arguments": {}}', "", [("f", {})]),  # EOS before the close
        ("<tool_call>bad<tool_call>" + '{"name": "f"}</tool_call>', "<tool_call>bad", [("f", {})]),
    ],
    "llama3": [
        (llama3_call("f", {"a": 1}), "", [("f", {"a": 1})]),
        # a JSON answer with a "name" but no arguments is an answer, not a call
        ('{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
        (
            llama3_call("f", {}) + "; " + llama3_call("g", {"b": 2}),
            "",
            [("f", {}), ("g", {"b": 2})],
        ),
        ("<|python_tag|>" + llama3_call("f", {"a": 1}), "", [("f", {"a": 1})]),
        ("Sure. <|python_tag|>" + llama3_call("f", {}), "Sure.", [("f", {})]),
        ("The answer is 4.", "The answer is 4.", []),
        ('{"answer": 4}', '{"answer": 4}', []),
        ('{"name": "f", "parameters": {"a": }', '{"name": "f", "parameters": {"a": }', []),
        ("<|python_tag|>search.call(q='x')", "<|python_tag|>search.call(q='x')", []),
        ("Text " + llama3_call("f", {}), "Text " + llama3_call("f", {}), []),
        (llama3_call("f", ARGS, ascii=True), "", [("f", ARGS)]),
        (llama3_call("f", {}) + "; oops", "; oops", [("f", {})]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
        (
            '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]',
            "",
            [("f", {}), ("g", {"b": 2})],
        ),
        (mistral_call("f", {"a": 1}) + mistral_call("g", {}), "", [("f", {"a": 1}), ("g", {})]),
        ("Checking. " + mistral_call("f", {}), "Checking.", [("f", {})]),
        ("[CALLS] are [brackets]", "[CALLS] are [brackets]", []),
        ("[TOOL_CALLS][{bad json}]", "[TOOL_CALLS][{bad json}]", []),
        ("[TOOL_CALLS]f[ARGS]{oops", "[TOOL_CALLS]f[ARGS]{oops", []),
        ("[TOOL_CALLS]two words[ARGS]{}", "[TOOL_CALLS]two words[ARGS]{}", []),
        ("[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{}", "", [("f", {})]),
        (mistral_call("f", ARGS, ascii=True), "", [("f", ARGS)]),
    ],
}


@pytest.mark.parametrize(
    ("family", "text", "content", "calls"),
    [(family, *case) for family, cases in CANNED.items() for case in cases],
)
def test_canned_outputs(family: str, text: str, content: str, calls: list) -> None:
    parser = PARSERS[family]()
    assert calls_of(parser, text) == (content, calls)
    assert_stream_matches_parse(parser, text, list(text))  # one character at a time
    assert_stream_matches_parse(parser, text, [text])


def test_arguments_are_canonical_json() -> None:
    text = '<tool_call>{"name":"f","arguments":{"a":[1,2],"é":"\\u00e9"}}</tool_call>'
    _, [call] = PARSERS["hermes"]().parse(text)
    assert call.arguments == '{"a": [1, 2], "é": "é"}'


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_ids(family: str) -> None:
    text = {"hermes": hermes_call, "llama3": llama3_call, "mistral": mistral_call}[family]("f", {})
    ids = {PARSERS[family]().parse(text)[1][0].id for _ in range(20)}
    pattern = r"[A-Za-z0-9]{9}" if family == "mistral" else r"call_[A-Za-z0-9]{24}"
    assert len(ids) == 20 and all(re.fullmatch(pattern, i) for i in ids)


def test_partial_marker_is_held_back_then_released() -> None:
    stream = PARSERS["hermes"]().stream()
    assert stream.feed("Hello <tool_") == ("Hello", [])
    assert stream.feed("ish> there") == (" <tool_ish> there", [])
    assert stream.finish() == ("", [])


def test_call_deltas_come_when_the_call_closes() -> None:
    stream = PARSERS["hermes"]().stream()
    assert stream.feed('Hi\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}') == ("Hi", [])
    text, deltas = stream.feed("\n</tool_call>")
    assert text == ""
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", ""), (0, None, '{"a": 1}')]
    assert deltas[0].id and deltas[1].id is None
    assert stream.finish() == ("", [])


def test_llama3_holds_a_possible_call_until_it_is_known() -> None:
    stream = PARSERS["llama3"]().stream()
    assert stream.feed('{"name": "f", "parameters": {"x": "}"') == ("", [])
    text, deltas = stream.feed("}}")
    assert text == "" and [d.arguments for d in deltas] == ["", '{"x": "}"}']
    assert stream.feed("\nand then") == ("and then", [])


def test_llama3_takes_only_offered_functions_as_calls() -> None:
    """A bare JSON answer that looks like a call to a function nobody offered stays content;
    the marker-delimited families keep calls to any name (their markers say it is a call)."""
    person = llama3_call("Ada", {"born": 1815})
    offered = PARSERS["llama3"](frozenset({"f"}))
    assert offered.parse(person) == (person, [])
    assert offered.parse("<|python_tag|>" + person) == ("<|python_tag|>" + person, [])
    content, calls = offered.parse(llama3_call("f", {"a": 1}) + "; " + person)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert content == "; " + person
    assert [c.name for c in PARSERS["llama3"]().parse(person)[1]] == ["Ada"]
    assert [c.name for c in PARSERS["hermes"](frozenset({"f"})).parse(hermes_call("g", {}))[1]] == [
        "g"
    ]


def test_detect_parser() -> None:
    assert detect_parser(None) is None
    assert detect_parser("{{'<|im_start|>' + message['role'] + '\n' + message['content']}}") is None
    assert detect_parser("{{- '<tool_call>\\n' }}{{ tools | tojson }}") == "hermes"
    assert detect_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3"
    llama = '<|start_header_id|>{{ "{\\"name\\": \\"" + name + "\\", \\"parameters\\": " }}'
    assert detect_parser(llama) == "llama3"
    assert detect_parser('{{ "[AVAILABLE_TOOLS]" }}{{ "[TOOL_CALLS]" }}') == "mistral"


# --- every chunking equals parse --------------------------------------------------------------

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)
TRICKY = st.text(alphabet='aZé😀"\\{}[]:;,<>/ \n', max_size=6)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | TRICKY,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TRICKY, kids, max_size=3),
    max_leaves=8,
)
ARG_OBJECTS = st.dictionaries(TRICKY, JSON_VALUES, max_size=4)
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "\n", '{"name": "f"}', "{", "}"],
    "llama3": ["<|python_tag|>", "<|python", ";", " ", '{"name": "f"', '"parameters": {}}', "{"],
    "mistral": ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[CALL_ID]", "f", "[", "]", "{}", '"'],
}
RENDER = {"hermes": hermes_call, "llama3": llama3_call, "mistral": mistral_call}


@st.composite
def family_text(draw: st.DrawFn, family: str) -> str:
    """Calls, malformed calls, marker fragments and plain text, in any order."""
    pieces = st.one_of(
        st.builds(RENDER[family], NAMES, ARG_OBJECTS, st.booleans()),
        st.sampled_from(FRAGMENTS[family]),
        st.text(alphabet='ab é"{}[]<>;\n ', max_size=8),
    )
    return "".join(draw(st.lists(pieces, max_size=6)))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), family=st.sampled_from(sorted(PARSERS)))
def test_any_chunking_streams_what_parse_returns(data: st.DataObject, family: str) -> None:
    text = data.draw(family_text(family))
    cuts = data.draw(st.sets(st.integers(0, len(text)), max_size=12))
    assert_stream_matches_parse(PARSERS[family](), text, chunked(text, cuts))


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    family=st.sampled_from(sorted(PARSERS)),
    calls=st.lists(st.tuples(NAMES, ARG_OBJECTS), min_size=1, max_size=3),
    before=st.text(alphabet="ab é.!\n", max_size=10),
)
def test_well_formed_calls_parse_exactly(
    data: st.DataObject, family: str, calls: list, before: str
) -> None:
    joiner = "; " if family == "llama3" else "\n"
    body = joiner.join(RENDER[family](n, a) for n, a in calls)
    if family == "llama3" and before:
        body = "<|python_tag|>" + body
    text = before + body
    parser = PARSERS[family]()
    assert calls_of(parser, text) == (before.rstrip(), calls)
    cuts = data.draw(st.sets(st.integers(0, len(text)), max_size=12))
    assert_stream_matches_parse(parser, text, chunked(text, cuts))
