"""OpenAI and native request models (pydantic v2). Unknown fields are accepted and ignored.

Each request knows how to turn its sampling fields into the SGLang-named `sampling_params` dict
that `GenerateReqInput` carries; only fields the client set are passed, so the TokenizerManager's
defaults apply to the rest.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(_Lenient):
    """Fields common to /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
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
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
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
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
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
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

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
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0)
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


class OpenSessionRequest(_Lenient):
    session_id: str | None = None
    timeout: float | None = Field(default=None, ge=0)  # idle seconds before it closes
    capacity_of_str_len: int | None = Field(default=None, ge=0)  # accepted, not enforced


class CloseSessionRequest(_Lenient):
    session_id: str


FinishReason = Literal["stop", "length"]
