"""DetokenizerManager: owns the incremental detokenization state of every live request."""

from __future__ import annotations

from typing import Any

from sluice.detokenizer.incremental import (
    DecodeFn,
    IncrementalDetokenizer,
    byte_level_pieces,
    make_decode_fn,
)
from sluice.messages import BatchStrOutput, BatchTokenIDOutput


class DetokenizerManager:
    """Turns scheduler token-id batches into text batches.

    Ownership: one `IncrementalDetokenizer` per rid, created on the rid's first update and
    dropped on its finishing update or on `abort`, so a finished request leaves no state here.
    """

    def __init__(
        self, tokenizer: Any, pieces: dict[bool, list[bytes] | None] | None = None
    ) -> None:
        """`pieces`: `byte_level_pieces` of the tokenizer by skip_special_tokens, made ahead
        (the process and the Engine make both at start-up: about 0.12 s each for a 49k
        vocabulary); what is not given is made on first use."""
        self._tokenizer = tokenizer
        # by (owner, rid): two HTTP workers' requests may share a client's rid (the scheduler
        # refuses the second; its refusal must not end the first's state)
        self._states: dict[tuple[str, str], IncrementalDetokenizer] = {}
        # one decode function per (skip_special_tokens, spaces_between_special_tokens)
        self._decode_fns: dict[tuple[bool, bool], DecodeFn] = {}
        # each id's bytes per skip_special_tokens, where the tokenizer is byte-level BPE (else
        # None: windows of ids through the decode function), made on first use
        self._pieces: dict[bool, list[bytes] | None] = dict(pieces or {})

    @classmethod
    def with_pieces(cls, tokenizer: Any) -> DetokenizerManager:
        """A manager whose byte-level pieces are made now, both ways of skipping special
        tokens: for the detokenizer process and the Engine, at start-up."""
        return cls(tokenizer, {skip: byte_level_pieces(tokenizer, skip) for skip in (True, False)})

    def handle(self, out: BatchTokenIDOutput) -> BatchStrOutput:
        """Detokenizes one update; every field but the texts passes through unchanged."""
        texts = []
        for i, rid in enumerate(out.rids):
            key = (out.reply_to[i], rid)
            state = self._states.get(key) or self._new_state(key, out, i)
            finish = out.finished_reasons[i]
            texts.append(state.add(out.new_token_ids[i], finish))
            if finish is not None:
                del self._states[key]
        return BatchStrOutput(
            rids=out.rids,
            texts=texts,
            new_token_ids=out.new_token_ids,
            finished_reasons=out.finished_reasons,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_token_logprobs=out.output_token_logprobs,
            output_top_logprobs=out.output_top_logprobs,
            input_token_logprobs=out.input_token_logprobs,
            input_top_logprobs=out.input_top_logprobs,
        )

    def abort(self, rid: str, owner: str) -> None:
        self._states.pop((owner, rid), None)

    def num_states(self) -> int:
        return len(self._states)

    def _new_state(
        self, key: tuple[str, str], out: BatchTokenIDOutput, i: int
    ) -> IncrementalDetokenizer:
        flags = (out.skip_special_tokens[i], out.spaces_between_special_tokens[i])
        decode_fn = self._decode_fns.get(flags)
        if decode_fn is None:
            decode_fn = make_decode_fn(self._tokenizer, *flags)
            self._decode_fns[flags] = decode_fn
        skip = flags[0]
        if skip not in self._pieces:
            self._pieces[skip] = byte_level_pieces(self._tokenizer, skip)
        state = IncrementalDetokenizer(
            self._tokenizer,
            stop_strings=out.stop_strings[i],
            no_stop_trim=out.no_stop_trim[i],
            decode_fn=decode_fn,
            pieces=self._pieces[skip],
        )
        self._states[key] = state
        return state
