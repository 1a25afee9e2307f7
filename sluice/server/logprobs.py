"""Logprob formatting: the chat shape (`content[]`) and the legacy completions shape.

Input pairs are `(logprob, token_id)` as the TokenizerManager gives them (a logprob may be None
for the first prompt token). Token strings are the token decoded alone; `bytes` are its exact
UTF-8 bytes (a token may hold part of a multi-byte character).
"""

from __future__ import annotations

import math
from typing import Any

LogprobPair = tuple[float | None, int]
# -inf is not JSON: report it as this floor, like other servers do
MIN_LOGPROB = -9999.0


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def clamp(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return max(float(logprob), MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


class TokenText:
    """Per-token text and bytes, cached by token id (the cache is bounded by the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._text[token_id]

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            self._bytes[token_id] = self._exact_bytes(token_id)
        return self._bytes[token_id]

    def _exact_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in _BYTE_DECODER for c in piece):
            if self.text(token_id) != piece:  # byte-level BPE (special tokens decode to piece)
                return bytes(_BYTE_DECODER[c] for c in piece)
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])  # sentencepiece byte fallback
        return self.text(token_id).encode("utf-8")


def chat_logprobs(
    tokens: TokenText, pairs: list[LogprobPair], tops: list[list[LogprobPair]] | None
) -> dict[str, Any]:
    """`{"content": [...], "refusal": None}` for the tokens in `pairs`."""
    content = []
    for i, (lp, tid) in enumerate(pairs):
        entry = _chat_entry(tokens, lp, tid)
        top = tops[i] if tops and i < len(tops) and tops[i] else []
        entry["top_logprobs"] = [_chat_entry(tokens, t_lp, t_id) for t_lp, t_id in top]
        content.append(entry)
    return {"content": content, "refusal": None}


def _chat_entry(tokens: TokenText, lp: float | None, tid: int) -> dict[str, Any]:
    return {"token": tokens.text(tid), "logprob": clamp(lp), "bytes": list(tokens.bytes(tid))}


def legacy_logprobs(
    tokens: TokenText,
    pairs: list[LogprobPair],
    tops: list[list[LogprobPair]] | None,
    num_top: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """The completions shape; `text_offset` is where the first token starts in the choice text."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for i, (lp, tid) in enumerate(pairs):
        text = tokens.text(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(clamp(lp))
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        top = tops[i] if tops and i < len(tops) else None
        if lp is None or top is None:
            out["top_logprobs"].append(None)
        else:
            out["top_logprobs"].append({tokens.text(t): clamp(t_lp) for t_lp, t in top})
    if num_top == 0:
        out["top_logprobs"] = None
    return out


def merge_legacy(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Prompt (echo) logprobs followed by output logprobs, in one legacy object."""
    if first is None:
        return second
    merged = {
        k: list(first[k]) + list(second[k]) for k in ("tokens", "token_logprobs", "text_offset")
    }
    if first["top_logprobs"] is None or second["top_logprobs"] is None:
        merged["top_logprobs"] = None
    else:
        merged["top_logprobs"] = first["top_logprobs"] + second["top_logprobs"]
    return merged
