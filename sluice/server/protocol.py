"""OpenAI and native request models (pydantic v2). Unknown fields are accepted and ignored.

Every integer field is a `bounded_int`: a value outside the range it means (always inside what
the wire to the scheduler carries, int64) is a 400 naming the field and the range. The token ids
of prompts are checked against the vocabulary by the TokenizerManager, before anything is sent.

Each request knows how to turn its sampling fields into the SGLang-named `sampling_params` dict
that `GenerateReqInput` carries; only fields the client set are passed, so the TokenizerManager's
defaults apply to the rest.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sluice.tokenizer.normalize import INT64_MAX, INT64_MIN, MAX_N, int_range_problem

# generation options shared by chat and completions: OpenAI name -> SGLang name
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "stop_token_ids": "stop_token_ids",
    "no_stop_trim": "no_stop_trim",
    "n": "n",
}

MAX_TOP_LOGPROBS = 20
# OpenAI's default max_tokens of the legacy completions API (chat: the rest of the context)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def bounded_int(lo: int = INT64_MIN, hi: int = INT64_MAX) -> Any:
    """An int field that accepts [lo, hi] only (a 400 saying so otherwise)."""

    def check(value: int) -> int:
        problem = int_range_problem(value, lo, hi)
        if problem is not None:
            raise PydanticCustomError("int_range", problem)
        return value

    return Annotated[int, AfterValidator(check)]


Count = bounded_int(0)  # a number of tokens, or of anything
TokenId = bounded_int(0)  # within the vocabulary is checked where the vocabulary is known
Positive = bounded_int(1)
Seed = bounded_int()
TopK = bounded_int(-1)  # -1: no limit
NumSamples = bounded_int(1, MAX_N)
NumTopLogprobs = bounded_int(0, MAX_TOP_LOGPROBS)
LogprobStart = bounded_int(-1)  # -1: no prompt logprobs


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(_Lenient):
    """Fields common to /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: NumSamples = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_tokens: Count | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    user: str | None = None
    rid: str | None = None
    # extension: seconds the request may take in all before it ends with 503 "timeout"
    timeout: float | None = Field(default=None, ge=0)
    # extension: continue a session ({id, rid, offset, replace, drop_previous_output})
    session_params: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            problem = (
                int_range_problem(int(key), 0, INT64_MAX)
                if _TOKEN_ID_KEY.fullmatch(key)
                else f"must be an integer, got {key[:40]!r}"
            )
            if problem is not None:
                raise PydanticCustomError("token_id", f"each key (a token id) {problem}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for name, internal in _SAMPLING_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                params[internal] = value
        if self.max_new_tokens() is not None:
            params["max_new_tokens"] = self.max_new_tokens()
        if self.stop is not None:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logit_bias:
            params["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return params


class ChatMessage(_Lenient):
    role: str
    # a string, or content parts such as {"type": "text", "text": ...}
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(_part_text(p) for p in self.content)
        return out


def _part_text(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind in ("text", "input_text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image_url", "input_image", "image", "audio", "input_audio", "video_url"):
        raise ValueError(f"content part of type {kind!r}: this model accepts text only")
    raise ValueError(f"unsupported content part {kind!r}: expected {{'type': 'text', 'text': ...}}")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumTopLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def max_new_tokens(self) -> int | None:
        """max_tokens and max_completion_tokens are synonyms; the smaller one wins."""
        given = [v for v in (self.max_tokens, self.max_completion_tokens) if v is not None]
        return min(given) if given else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    echo: bool = False
    logprobs: NumTopLogprobs | None = None
    suffix: str | None = None

    def max_new_tokens(self) -> int:
        """OpenAI's legacy default when max_tokens is not given (or null)."""
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: PromptInput) -> PromptInput:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class GenerateRequest(_Lenient):
    """SGLang's native /generate body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: LogprobStart = -1
    top_logprobs_num: Count = 0
    session_params: dict[str, Any] | None = None
    timeout: float | None = Field(default=None, ge=0)  # seconds in all (503 "timeout" after)

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    text: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _has_text(self) -> TokenizeRequest:
        if self.prompt is None and self.text is None:
            raise ValueError("give prompt (or text)")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class AbortRequest(_Lenient):
    rid: str | None = None
    abort_all: bool = False


class PauseGenerationRequest(_Lenient):
    """SGLang's /pause_generation body. `in_place`: requests keep their state and queue;
    `abort`: every request in flight is aborted first. (`retract`, which frees the KV of
    running requests, is not supported.)"""

    mode: Literal["abort", "in_place"] = "abort"


class OpenSessionRequest(_Lenient):
    session_id: str | None = None
    timeout: float | None = Field(default=None, ge=0)  # idle seconds before it closes
    capacity_of_str_len: Count | None = None  # tokens a turn's prompt may hold (0: no limit)


class CloseSessionRequest(_Lenient):
    session_id: str


FinishReason = Literal["stop", "length"]
