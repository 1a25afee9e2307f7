"""GenerateReqInput: the native request of the HTTP process (SGLang's /generate body).

The OpenAI routes convert their requests into one of these; the TokenizerManager consumes it.
It may hold one prompt or a batch (a list of texts or of token-id lists), and `n` parallel
samples per prompt (in `sampling_params["n"]`). Lives in the HTTP process only; what crosses to
the scheduler is `messages.TokenizedGenerateReqInput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateReqInput:
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # one dict for every prompt, or one per prompt
    sampling_params: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    session_params: dict[str, Any] | None = None
    timeout: float = 0.0  # seconds, 0: none
    grammar_after_id: int = -1  # these two: see messages.TokenizedGenerateReqInput
    reasoning_start_id: int = -1
    # image references (URLs, data: URIs): one or a list for a single prompt; for a batch,
    # one entry per prompt (a reference, a list, or None); see tokenizer/images.py
    image_data: str | list[Any] | None = None

    @property
    def is_single(self) -> bool:
        prompts = self.text if self.text is not None else self.input_ids
        return isinstance(prompts, str) or (
            isinstance(prompts, list) and (not prompts or isinstance(prompts[0], int))
        )

    @property
    def num_prompts(self) -> int:
        if self.is_single:
            return 1
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts or [])
