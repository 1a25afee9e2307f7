"""IncrementalDetokenizer: UTF-8 safety, split invariance, stop strings, special tokens; each
both ways on the default tokenizer (byte-level BPE): on its ids' bytes (`byte_level_pieces`, what
the detokenizer process runs for it) and on windows of ids through the tokenizer."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from sluice.detokenizer import incremental
from sluice.detokenizer.incremental import (
    IncrementalDetokenizer,
    byte_level_pieces,
    find_stop,
    stop_prefix_len,
)
from sluice.messages import FinishReason

LENGTH = FinishReason(type="length")

TEXTS = {
    "cjk": "你好，世界！今日は良い天気ですね。안녕하세요 세계",
    "emoji": "Party 🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 done ✅",
    "thai": "สวัสดีครับ ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "mixed": "def f(x):\n    return x ** 2  # ½ café naïve Ωμέγα — «quoted» ñ 😀\n\n\tend",
    "english": " Hello world, this is a test of the incremental detokenizer.  Double  spaces.",
}


_PIECES: dict[bool, list[bytes] | None] = {}  # of the session's default tokenizer


def pieces_of(tokenizer: Any, skip_special_tokens: bool) -> list[bytes]:
    if skip_special_tokens not in _PIECES:
        _PIECES[skip_special_tokens] = byte_level_pieces(tokenizer, skip_special_tokens)
    pieces = _PIECES[skip_special_tokens]
    assert pieces is not None, "the default tokenizer is byte-level BPE: it must have pieces"
    return pieces


@pytest.fixture(params=["bytes", "window"])
def make(request):
    """IncrementalDetokenizer(tokenizer, ...), on the ids' bytes or on windows of ids."""

    def build(tok: Any, skip_special_tokens: bool = True, **kw: Any) -> IncrementalDetokenizer:
        if request.param == "bytes":
            kw.setdefault("pieces", pieces_of(tok, skip_special_tokens))
        return IncrementalDetokenizer(tok, skip_special_tokens, **kw)

    return build


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, chunks: list[list[int]], finish: FinishReason | None):
    """The increments of feeding `chunks` one `add` each, `finish` with the last one."""
    return [det.add(c, finish if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)]


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[i] for i in ids]


def random_split(ids: list[int], rng: random.Random) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, min(8, len(ids) - 1))))
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def one_call(
    make, tokenizer: Any, ids: list[int], finish: FinishReason | None = LENGTH, **kw
) -> str:
    return make(tokenizer, **kw).add(ids, finish)


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_token_by_token_round_trip_has_no_replacement_char(make, tokenizer, name):
    text = TEXTS[name]
    ids = encode(tokenizer, text)
    increments = stream(make(tokenizer), one_by_one(ids), LENGTH)
    assert all("\ufffd" not in piece for piece in increments)
    assert "".join(increments) == text == tokenizer.decode(ids)


def test_multi_token_character_is_held_until_complete(make, tokenizer):
    ids = encode(tokenizer, "a🎉")
    assert len(ids) >= 3  # the emoji spans several byte-level tokens
    increments = stream(make(tokenizer), one_by_one(ids), None)
    assert increments[0] == "a"
    assert increments[1:-1] == [""] * (len(ids) - 2)
    assert increments[-1] == "🎉"


def test_finish_flushes_an_incomplete_character(make, tokenizer):
    ids = encode(tokenizer, "ok 🎉")[:-1]
    det = make(tokenizer)
    held = stream(det, one_by_one(ids), None)
    # the space shares a token with the emoji's first byte: windows hold that whole token, the
    # bytes only the incomplete character
    assert "".join(held) in ("ok", "ok ")
    assert det.add([], LENGTH).endswith("\ufffd")
    assert det.text == tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(4))
def test_random_splits_match_one_call_and_full_decode(make, tokenizer, seed):
    rng = random.Random(seed)
    for text in TEXTS.values():
        ids = encode(tokenizer, text * 3)
        expected = tokenizer.decode(ids)
        assert one_call(make, tokenizer, ids) == expected
        for _ in range(10):
            det = make(tokenizer)
            assert "".join(stream(det, random_split(ids, rng), LENGTH)) == expected


@pytest.mark.parametrize("seed", range(3))
def test_random_ids_split_invariance(make, tokenizer, seed):
    """Arbitrary ids (many invalid byte sequences, special tokens) behave like real text."""
    rng = random.Random(seed)
    vocab_size = len(tokenizer)
    for skip in (True, False):
        ids = [rng.randrange(vocab_size) for _ in range(300)]
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert one_call(make, tokenizer, ids, skip_special_tokens=skip) == expected
        for chunks in (one_by_one(ids), random_split(ids, rng), random_split(ids, rng)):
            det = make(tokenizer, skip_special_tokens=skip)
            assert "".join(stream(det, chunks, LENGTH)) == expected


def test_skip_special_tokens_both_ways(make, tokenizer):
    ids = encode(tokenizer, "<|im_start|>assistant\nHi there<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    kept = "".join(stream(make(tokenizer, False), one_by_one(ids), LENGTH))
    skipped = "".join(stream(make(tokenizer, True), one_by_one(ids), LENGTH))
    assert kept == "<|im_start|>assistant\nHi there<|im_end|>"
    assert skipped == "assistant\nHi there" == tokenizer.decode(ids, skip_special_tokens=True)


def test_matched_stop_token_is_trimmed_unless_no_stop_trim(make, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*encode(tokenizer, "Hi there"), eos]
    finish = FinishReason(type="stop", matched=eos)
    assert one_call(make, tokenizer, ids, finish, skip_special_tokens=False) == "Hi there"
    kept = one_call(make, tokenizer, ids, finish, skip_special_tokens=False, no_stop_trim=True)
    assert kept == "Hi there<|im_end|>"


def test_window_is_rebased_and_work_is_bounded(tokenizer):
    """After thousands of tokens one `add` still decodes only a short window."""
    calls: list[int] = []

    def counting_decode(ids: list[int]) -> str:
        calls.append(len(ids))
        return tokenizer.decode(ids)

    ids = encode(tokenizer, TEXTS["english"] * 40)
    det = IncrementalDetokenizer(tokenizer, decode_fn=counting_decode)
    assert "".join(stream(det, one_by_one(ids), LENGTH)) == tokenizer.decode(ids)
    assert len(ids) > 500
    assert max(calls) <= 20
    assert len(calls) < 1.3 * len(ids)


# ----------------------------------------------------------------------------- stop strings


STOP_TEXT = "Hello world, this is the END of the story and more."


def test_multi_token_stop_string_never_leaks(make, tokenizer):
    ids = encode(tokenizer, STOP_TEXT)
    det = make(tokenizer, stop_strings=["the END"])
    increments = stream(det, one_by_one(ids), None)
    emitted = "".join(increments)
    assert emitted == "Hello world, this is "
    assert not any(p in emitted for p in ("the END", "the E", " of"))
    assert det.is_stopped
    assert det.add(encode(tokenizer, " more"), LENGTH) == ""
    assert det.text == emitted


def test_partial_stop_prefix_is_held_then_released(make, tokenizer):
    ids = encode(tokenizer, STOP_TEXT)
    det = make(tokenizer, stop_strings=["the ENDING"])
    emitted = ""
    was_held = False
    for token in ids:
        emitted += det.add([token], None)
        decoded = tokenizer.decode(det.output_ids)
        assert "the E" not in emitted or "the END " in decoded
        was_held |= decoded.endswith("the END") and not emitted.endswith("END")
    assert was_held
    assert emitted + det.add([], LENGTH) == STOP_TEXT
    assert not det.is_stopped


def test_no_stop_trim_keeps_the_stop_string(make, tokenizer):
    ids = encode(tokenizer, STOP_TEXT)
    det = make(tokenizer, stop_strings=["the END"], no_stop_trim=True)
    assert "".join(stream(det, one_by_one(ids), None)) == "Hello world, this is the END"


def test_finish_with_matched_stop_string_ends_before_it(make, tokenizer):
    ids = encode(tokenizer, "Answer: 42\n\nQuestion")
    finish = FinishReason(type="stop", matched="\n\nQ")
    listed = one_call(make, tokenizer, ids, finish, stop_strings=["\n\nQ"])
    unlisted = one_call(make, tokenizer, ids, finish)
    kept = one_call(make, tokenizer, ids, finish, stop_strings=["\n\nQ"], no_stop_trim=True)
    assert listed == unlisted == "Answer: 42"
    assert kept == "Answer: 42\n\nQ"


def test_finish_flushes_a_held_prefix(make, tokenizer):
    ids = encode(tokenizer, "The answer is STO")
    det = make(tokenizer, stop_strings=["STOP"])
    assert "".join(stream(det, one_by_one(ids), None)) == "The answer is "
    assert det.add([], LENGTH) == "STO"


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_stop_strings_random_split_invariance(make, tokenizer, no_stop_trim):
    rng = random.Random(7)
    stops = ["the END", "story", "🎉!", "e t"]
    for text in (STOP_TEXT, "Yay 🎉 then 🎉! and the story", "no stop here at all 你好"):
        ids = encode(tokenizer, text)
        kw = {"stop_strings": stops, "no_stop_trim": no_stop_trim}
        expected = one_call(make, tokenizer, ids, **kw)
        for _ in range(15):
            det = make(tokenizer, **kw)
            increments = stream(det, random_split(ids, rng), LENGTH)
            assert "".join(increments) == expected
        cut = find_stop(tokenizer.decode(ids), stops, no_stop_trim)
        assert expected == tokenizer.decode(ids)[:cut]


def test_find_stop_prefers_the_earliest_ending_match():
    assert find_stop("xabcd", ["abcd", "bc"], keep_stop=False) == 2
    assert find_stop("xabcd", ["bc", "abc"], keep_stop=False) == 1
    assert find_stop("xabcd", ["bc", "abc"], keep_stop=True) == 4
    assert find_stop("xabcd", ["zz"], keep_stop=False) is None


def test_stop_prefix_len_is_the_longest_held_suffix():
    assert stop_prefix_len("say the EN", ["the END", "N"]) == 6
    assert stop_prefix_len("say th", ["xyz"]) == 0
    assert stop_prefix_len("ab", ["abc"]) == 2


# ----------------------------------------------------------------------------- cost


def test_add_one_token_cost(make, tokenizer):
    ids = encode(tokenizer, (TEXTS["english"] + TEXTS["mixed"] + TEXTS["cjk"]) * 30)[:2000]
    assert len(ids) == 2000
    for stops in ((), ("<|STOP|>", "\n\n\n\n", "the END")):
        costs = []
        for _ in range(3):  # the best of a few: a sanity bound, not a benchmark
            det = make(tokenizer, stop_strings=stops)
            start = time.perf_counter()
            for token in ids:
                det.add([token], None)
            costs.append((time.perf_counter() - start) / len(ids) * 1e6)
            assert not det.is_stopped
        us_per_token = min(costs)
        print(f"add(1 token), {len(stops)} stop strings: {us_per_token:.1f} us/token")
        assert us_per_token < 200


# ----------------------------------------------------------------------------- byte-level pieces


def test_byte_level_pieces_are_each_ids_bytes(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    kept, skipped = pieces_of(tokenizer, False), pieces_of(tokenizer, True)
    assert len(kept) == len(skipped) == len(tokenizer)
    assert kept[im_end] == b"<|im_end|>"
    assert skipped[im_end] == b""
    assert b"".join(kept[i] for i in encode(tokenizer, " Hello\n")) == b" Hello\n"
    emoji = encode(tokenizer, "🎉")
    assert len(emoji) > 1
    assert b"".join(kept[i] for i in emoji) == "🎉".encode()


def test_byte_level_pieces_refuse_other_tokenizers(metaspace_tokenizer):
    assert byte_level_pieces(metaspace_tokenizer, True) is None


def test_byte_level_pieces_that_disagree_with_the_tokenizer_are_refused(tokenizer, monkeypatch):
    """The pieces are checked against the tokenizer's own decode: a wrong byte alphabet (two
    bytes' characters swapped) gives None, not wrong text."""
    chars = incremental._byte_level_chars()
    swapped = {**chars, ord("a"): chars[ord("b")], ord("b"): chars[ord("a")]}
    monkeypatch.setattr(incremental, "_byte_level_chars", lambda: swapped)
    assert byte_level_pieces(tokenizer, True) is None


def test_a_negative_id_is_refused(make, tokenizer):
    with pytest.raises((ValueError, OverflowError)):
        make(tokenizer).add([*encode(tokenizer, "Hi"), -1], None)


def test_an_id_past_the_vocabulary_decodes_to_nothing(make, tokenizer):
    ids = encode(tokenizer, "Hello world")
    with_past = [ids[0], len(tokenizer) + 7, *ids[1:]]
    assert "".join(stream(make(tokenizer), one_by_one(with_past), LENGTH)) == "Hello world"


# ----------------------------------------------------------------------------- other tokenizers


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_metaspace_byte_fallback_tokenizer(metaspace_tokenizer, name):
    tok = metaspace_tokenizer
    rng = random.Random(name)
    ids = encode(tok, TEXTS[name] + " Hello world, the END")
    expected = tok.decode(ids)
    increments = stream(IncrementalDetokenizer(tok), one_by_one(ids), LENGTH)
    assert all("\ufffd" not in piece for piece in increments)
    assert "".join(increments) == expected == TEXTS[name] + " Hello world, the END"
    for _ in range(10):
        det = IncrementalDetokenizer(tok, stop_strings=["the END"])
        trimmed = "".join(stream(det, random_split(ids, rng), LENGTH))
        assert trimmed == expected[: expected.index("the END")]
