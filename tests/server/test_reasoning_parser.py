"""Reasoning parser: `<think>` splits, whole and streamed, equal for every chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.server.reasoning_parser import REASONING_PARSERS, ReasoningParser

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek-r1"]


def stream_all(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str, bool]:
    stream = parser.stream()
    reasoning, content = [], []
    for chunk in [*chunks, None]:
        r, c = stream.finish() if chunk is None else stream.feed(chunk)
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content), stream.has_reasoning


def assert_stream_matches_parse(parser: ReasoningParser, text: str, chunks: list[str]) -> None:
    reasoning, content = parser.parse(text)
    assert stream_all(parser, chunks) == (reasoning or "", content, reasoning is not None)


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        (QWEN3(), "<think>\nplan\n</think>\n\nAnswer.", ("\nplan\n", "Answer.")),
        (QWEN3(), "  <think>a</think>b", ("a", "b")),
        (QWEN3(), "No reasoning here.\n", (None, "No reasoning here.\n")),
        (QWEN3(), "Text <think>late</think>", (None, "Text <think>late</think>")),
        (QWEN3(), "<think>never closed\n", ("never closed\n", "")),
        (QWEN3(), "<think></think>", ("", "")),
        (QWEN3(), "<think>a</think> \nb\n", ("a", " \nb\n")),  # only newlines are stripped
        (QWEN3(), "", (None, "")),
        (QWEN3(), "<thin", (None, "<thin")),
        (R1(), "step 1</think>\n\nThe answer.", ("step 1", "The answer.")),
        (R1(), "<think>\nstep</think>ok", ("\nstep", "ok")),
        (R1(), "still thinking </thi", ("still thinking </thi", "")),
        (R1(), "", ("", "")),
        (ReasoningParser("[R]", "[/R]"), "[R]x[/R]\ny", ("x", "y")),
    ],
)
def test_parse(parser: ReasoningParser, text: str, expected: tuple[str | None, str]) -> None:
    assert parser.parse(text) == expected
    assert_stream_matches_parse(parser, text, list(text))
    assert_stream_matches_parse(parser, text, [text])


def test_split_tags_are_held_back() -> None:
    stream = QWEN3().stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Hmm</th") == ("Hmm", "")
    assert stream.feed("ink>\n") == ("", "")
    assert stream.feed("\nDone") == ("", "Done")
    assert stream.finish() == ("", "")
    assert stream.has_reasoning


def test_a_partial_tag_that_is_not_one_is_released() -> None:
    stream = R1().stream()
    assert stream.feed("a </th") == ("a ", "")
    assert stream.feed("e end") == ("</the end", "")
    assert stream.finish() == ("", "")


def test_enable_thinking_false_means_no_reasoning() -> None:
    off = QWEN3.for_request({"enable_thinking": False})
    assert off.parse("<think>x</think>y") == (None, "<think>x</think>y")
    assert stream_all(off, ["<think>x", "</think>y"]) == ("", "<think>x</think>y", False)
    assert QWEN3.for_request({"enable_thinking": True}).parse("<think>x</think>y") == ("x", "y")
    assert QWEN3.for_request(None).parse("<think>x</think>y") == ("x", "y")
    assert R1.for_request({}).starts_in_reasoning


PIECES = st.one_of(
    st.sampled_from(["<think>", "</think>", "<th", "</", "ink>", "\n", "\n\n", " "]),
    st.text(alphabet="ab <>/\nk", max_size=6),
)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    pieces=st.lists(PIECES, max_size=8),
    starts_in_reasoning=st.booleans(),
)
def test_any_chunking_streams_what_parse_returns(
    data: st.DataObject, pieces: list[str], starts_in_reasoning: bool
) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    assert_stream_matches_parse(parser, text, chunks)
