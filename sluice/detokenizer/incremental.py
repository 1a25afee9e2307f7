"""Incremental detokenization of one request's output ids.

Each `add` decodes only a short window of ids: `ids[surr:]` against its context `ids[surr:read]`
(the "prefix offset / read offset" technique), so leading spaces and BPE merges come out as in
the full text while the work per token stays bounded by the window length.

Two layers of holding back, each releasing text only once it is final:
- decoding: text whose last character is still incomplete (U+FFFD at the end) waits for the ids
  that complete it;
- stop strings: a suffix that could be the start of a stop string waits until it is known not
  to be one. Once a stop string appears, the text is cut there and nothing more is emitted.

Guarantee: for a tokenizer whose decode of a longer id list extends the decode of a shorter one
at character boundaries (byte-level BPE, SentencePiece), the increments concatenated equal the
text of one `add` with all ids and the same finish, however the ids are split into chunks.

Byte-level BPE (GPT-2's decoder, used by SmolLM2, Llama 3, Qwen2) needs no window: its text is
the UTF-8 decoding (errors replaced) of its ids' bytes laid end to end, where transformers adds
nothing to the decode (no clean-up of spaces, which Llama 3's published configuration asks for). For such a tokenizer
`byte_level_pieces` gives each id's bytes once, and an `add` joins the new ids' bytes and runs
them through an incremental UTF-8 decoder, which holds back an incomplete last character by
itself: no call into the tokenizer per token.
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Callable, Sequence
from typing import Any

from sluice.messages import FinishReason

DecodeFn = Callable[[list[int]], str]

_REPLACEMENT = "\ufffd"
# ids kept in front of the unread ones when the window is re-based
_CONTEXT_LEN = 4
# the window ids[surr:read] is re-based once it grows past this many ids
_MAX_WINDOW_LEN = 16
# a held tail at least this long cannot be one incomplete character: search it for a final prefix
_MAX_INCOMPLETE_LEN = 4
# how many token boundaries that search tries, and the held length past which all is emitted
_MAX_SCAN_LEN = 8
_MAX_HELD_LEN = 64


def make_decode_fn(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> DecodeFn:
    """ids -> text, equal to `tokenizer.decode` with these flags.

    Calls the Rust tokenizer directly when transformers would add nothing to it (a fast
    tokenizer without clean-up of tokenization spaces): that halves the cost per call.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _is_plain_fast(tokenizer):

        def decode_fast(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode_fast

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    return decode


def byte_level_pieces(tokenizer: Any, skip_special_tokens: bool) -> list[bytes] | None:
    """The bytes of each id of a byte-level BPE tokenizer, such that `tokenizer.decode(ids,
    skip_special_tokens=...)` is `b"".join(pieces[i] for i in ids)` decoded as UTF-8 with errors
    replaced (b"" for a skipped special token). None for any other tokenizer (SentencePiece's
    "▁" spaces and byte fallback, WordPiece's "##", a decoder sequence, a slow tokenizer, a
    clean-up of spaces) and should the check fail: every id's piece against the tokenizer's own
    decode of that id, and random runs of ids (invalid UTF-8 across pieces included)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _is_plain_fast(tokenizer):
        return None
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    to_byte = {c: b for b, c in _byte_level_chars().items()}
    size = max(backend.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
    skipped = set()
    if skip_special_tokens:
        skipped = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    pieces = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None or i in skipped:
            pieces.append(b"")
        elif all(c in to_byte for c in token):
            pieces.append(bytes(to_byte[c] for c in token))
        else:  # as the decoder does with a token it cannot map (an added token's own text)
            pieces.append(token.encode())
    # one decode a call, not decode_batch: that would start the tokenizers library's thread pool
    # in a process (the in-process Engine's) that may fork later
    for i, piece in enumerate(pieces):
        if piece.decode("utf-8", "replace") != backend.decode([i], skip_special_tokens):
            return None
    rng = random.Random(0)
    for _ in range(500):
        run = [rng.randrange(size) for _ in range(rng.randint(2, 16))]
        text = backend.decode(run, skip_special_tokens)
        if b"".join(pieces[i] for i in run).decode("utf-8", "replace") != text:
            return None
    return pieces


def _byte_level_chars() -> dict[int, str]:
    """Byte-level BPE's alphabet: each byte's character in its tokens. The printable bytes of
    Latin-1 (but the space) stand for themselves; the other 68 take the characters from U+0100
    on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + n)
    return chars


def _is_plain_fast(tokenizer: Any) -> bool:
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    )


class IncrementalDetokenizer:
    """Per-request state. Turns a growing list of output token ids into text increments.

    Invariants: `0 <= _surr <= _read <= len(output_ids)`; `_ctx_len == len(decode(ids[surr:read]))`;
    the decoded text of `ids[:read]` is `text + _unsent` (before any stop cut), and no stop
    string can start inside `text`. With `pieces`, `_surr` and `_ctx_len` are unused, and the
    decoded text of `ids[:read]` is `text + _unsent` and the UTF-8 decoder's held bytes.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop_strings: Sequence[str] = (),
        no_stop_trim: bool = False,
        decode_fn: DecodeFn | None = None,
        pieces: list[bytes] | None = None,
    ) -> None:
        """`pieces`: `byte_level_pieces(tokenizer, skip_special_tokens)`, to decode bytes
        instead of windows of ids (None: windows, through `decode_fn` or the tokenizer)."""
        self._pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if pieces else None
        self._decode = decode_fn or make_decode_fn(
            tokenizer, skip_special_tokens, spaces_between_special_tokens
        )
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._no_stop_trim = no_stop_trim
        self.output_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._surr = 0
        self._read = 0
        self._ctx_len = 0
        self._unsent = ""  # decoded, final, held back for the stop-string check
        self.is_stopped = False  # a stop string was found; later ids produce no text

    def add(self, new_ids: list[int], finish: FinishReason | None) -> str:
        """Appends `new_ids`; returns the new text that is now safe to emit.

        With `finish` set, everything left is flushed (minus stop trimming).
        """
        self.output_ids.extend(new_ids)
        if self.is_stopped:
            return ""
        is_final = finish is not None
        self._unsent += self._decode_step(self._decode_end(finish), is_final)
        out = self._release(is_final, self._stops_for(finish))
        self.text += out
        return out

    def _decode_end(self, finish: FinishReason | None) -> int:
        """End of the ids to decode: a matched stop token is left out unless `no_stop_trim`."""
        end = len(self.output_ids)
        if (
            finish is not None
            and finish.type == "stop"
            and isinstance(finish.matched, int)
            and not self._no_stop_trim
            and end > self._read
            and self.output_ids[-1] == finish.matched
        ):
            return end - 1
        return end

    def _stops_for(self, finish: FinishReason | None) -> tuple[str, ...]:
        matched = finish.matched if finish is not None and finish.type == "stop" else None
        if isinstance(matched, str) and matched and matched not in self._stop_strings:
            return (*self._stop_strings, matched)
        return self._stop_strings

    def _decode_step(self, end: int, is_final: bool) -> str:
        """Decodes `ids[read:end]`; returns the part of it whose text is final."""
        if self._utf8 is not None:
            return self._decode_bytes(end, is_final)
        if end <= self._read:
            return ""
        full = self._decode(self.output_ids[self._surr : end])
        if is_final or not full.endswith(_REPLACEMENT):
            return self._advance(full, end)
        held_len = end - self._read
        if held_len < _MAX_INCOMPLETE_LEN:
            return ""  # the last character may still be completed by the next ids
        new_text = self._advance_to_final_prefix(full, end)
        if self._read < end - _MAX_HELD_LEN:  # never resolves: ids without text
            new_text += self._advance(self._decode(self.output_ids[self._surr : end]), end)
        return new_text

    def _decode_bytes(self, end: int, is_final: bool) -> str:
        """`_decode_step` for byte-level pieces: an incomplete last character stays in the
        UTF-8 decoder until the ids that complete it (or the finish: U+FFFD) come."""
        new_ids = self.output_ids[self._read : end]
        self._read = max(self._read, end)
        if new_ids and min(new_ids) < 0:  # as the tokenizer refuses it, not a wrapped index
            raise ValueError(f"token id {min(new_ids)} is negative")
        pieces = self._pieces
        try:
            data = b"".join([pieces[i] for i in new_ids])
        except IndexError:  # an id past the tokenizer's vocabulary decodes to nothing
            data = b"".join([pieces[i] if i < len(pieces) else b"" for i in new_ids])
        return self._utf8.decode(data, is_final)

    def _advance(self, window_text: str, read: int) -> str:
        """Moves the read offset to `read`; `window_text` is the final decode of ids[surr:read]."""
        new_text = window_text[self._ctx_len :]
        self._read = read
        if read - self._surr > _MAX_WINDOW_LEN:
            self._rebase(read)
        else:
            self._ctx_len = len(window_text)
        return new_text

    def _rebase(self, read: int) -> None:
        """Starts the window a few ids before `read`, at the start of a character if one of the
        next few ids is one (byte-fallback decoders garble a whole byte run cut in the middle)."""
        for surr in range(read - _CONTEXT_LEN, read - _CONTEXT_LEN - _MAX_INCOMPLETE_LEN, -1):
            context = self._decode(self.output_ids[surr:read])
            if not context.startswith(_REPLACEMENT):
                break
        self._surr = surr
        self._ctx_len = len(context)

    def _advance_to_final_prefix(self, full: str, end: int) -> str:
        """The held ids are longer than any character: emits up to the last token boundary whose
        text is final. A boundary is final when the window's text there ends with a complete
        character, or is a prefix of `full` followed by a valid character (the ids after it
        have then decided how its last bytes decode). Returns "" and keeps the offsets when no
        tried boundary is final."""
        for k in range(end - 1, max(self._read, end - _MAX_SCAN_LEN), -1):
            text = self._decode(self.output_ids[self._surr : k])
            if not text.endswith(_REPLACEMENT) or (
                full.startswith(text) and full[len(text) :].strip(_REPLACEMENT)
            ):
                return self._advance(text, k)
        return ""

    def _release(self, is_final: bool, stops: tuple[str, ...]) -> str:
        """Takes from `_unsent` what may be emitted; keeps a possible stop-string start."""
        unsent = self._unsent
        if not stops:
            self._unsent = ""
            return unsent
        cut = find_stop(unsent, stops, self._no_stop_trim)
        if cut is not None:
            self.is_stopped = True
            self._unsent = ""
            return unsent[:cut]
        keep = len(unsent) if is_final else len(unsent) - stop_prefix_len(unsent, stops)
        self._unsent = unsent[keep:]
        return unsent[:keep]


def find_stop(text: str, stops: Sequence[str], keep_stop: bool) -> int | None:
    """Where to cut `text` at its first stop string, or None when it holds none.

    "First" is the match that ends earliest (where generation would have stopped); on a tie the
    longer one. The cut is at its start, or its end when `keep_stop`.
    """
    best: tuple[int, int] | None = None  # (end, start)
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            candidate = (start + len(stop), start)
            if best is None or candidate < best:
                best = candidate
    if best is None:
        return None
    return best[0] if keep_stop else best[1]


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held
