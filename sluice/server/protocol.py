"""OpenAI and native request models (pydantic v2). Unknown fields are accepted and ignored.

Every integer field is a `bounded_int`: a value outside the range it means (always inside what
the wire to the scheduler carries, int64) is a 400 naming the field and the range. The token ids
of prompts are checked against the vocabulary by the TokenizerManager, before anything is sent.

Each request knows how to turn its sampling fields into the SGLang-named `sampling_params` dict
that `GenerateReqInput` carries; only fields the client set are passed, so the TokenizerManager's
defaults apply to the rest.
"""

from __future__ import annotations

import json
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


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's `response_format`; a schema at `response_format.schema` is tolerated."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")

    def schema_text(self) -> str | None:
        """The JSON schema the output must follow, as JSON text; None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        schema = self.schema_ if schema is None else schema
        if schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return json.dumps(schema)


# grammar fields other servers take beside response_format: name -> SamplingParams field
_GRAMMAR_ALIASES = {
    "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",  # SGLang
    "guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf",  # vLLM
}  # fmt: skip
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "ebnf"}


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
    response_format: ResponseFormat | None = None
    # extensions: a grammar of SGLang's (json_schema, regex, ebnf) or vLLM's (guided_json,
    # guided_regex, guided_grammar, guided_choice, structured_outputs) naming
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingRequest:
        self.grammar()
        return self

    def grammar(self) -> dict[str, str]:
        """The output's grammar as a SamplingParams field ({} or one of json_schema, regex,
        ebnf -> text), from whichever API's field gives it; more than one is a ValueError."""
        given: list[tuple[str, str, Any]] = []  # (request field, grammar kind, value)
        if self.response_format is not None:
            text = self.response_format.schema_text()
            if text is not None:
                given.append(("response_format", "json_schema", text))
        for name, kind in _GRAMMAR_ALIASES.items():
            if getattr(self, name) is not None:
                given.append((name, kind, getattr(self, name)))
        if self.guided_choice is not None:
            given.append(("guided_choice", "ebnf", _choice_grammar(self.guided_choice)))
        for key, value in (self.structured_outputs or {}).items():
            if key not in _STRUCTURED_OUTPUTS:
                raise ValueError(f"structured_outputs.{key} is not supported")
            text = _choice_grammar(value) if key == "choice" else value
            given.append((f"structured_outputs.{key}", _STRUCTURED_OUTPUTS[key], text))
        if len(given) > 1:
            names = " and ".join(name for name, _, _ in given)
            raise ValueError(f"give one way of constraining the output, not {names}")
        if not given:
            return {}
        _, kind, value = given[0]
        return {kind: value if isinstance(value, str) else json.dumps(value)}

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
        params.update(self.grammar())
        return params


class ChatMessage(_Lenient):
    role: str
    # a string, or content parts such as {"type": "text", "text": ...}
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined into one string; with
        image parts, the parts (the TokenizerManager renders the images' placeholders)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = [_part(p) for p in self.content]
            if all(isinstance(p, str) for p in parts):
                out["content"] = "\n".join(parts)  # type: ignore[arg-type]
            else:
                out["content"] = [
                    {"type": "text", "text": p} if isinstance(p, str) else p for p in parts
                ]
        return out


def _choice_grammar(choices: Any) -> str:
    """A Lark grammar matching exactly one of `choices` (strings)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("a choice of outputs must be a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _part(part: dict[str, Any]) -> str | dict[str, Any]:
    """A text part's text, or an image_url part as it is (its URL checked for a string)."""
    kind = part.get("type")
    if kind in ("text", "input_text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise ValueError("an image_url part needs {'image_url': {'url': <string>}}")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind in ("input_image", "image"):
        raise ValueError(f"content part of type {kind!r}: send images as image_url parts")
    if kind in ("audio", "input_audio", "video_url"):
        raise ValueError(f"content part of type {kind!r}: this model accepts text and images only")
    raise ValueError(f"unsupported content part {kind!r}: expected {{'type': 'text', 'text': ...}}")


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: NumTopLogprobs | None = None
    tools: list[Tool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names the function {self.tool_choice.function.name!r}, which "
                    f"is not among the tools ({', '.join(names) or 'none given'})"
                )
        strict = [t.function.name for t in self.tools or [] if t.function.strict]
        if strict and self.uses_tools and self.forced_tool is None:
            raise ValueError(
                f"the function {strict[0]!r} is strict, but its parameters are enforced only "
                "when the call is forced: use tool_choice 'required' or name the function"
            )
        if self.uses_tools and self.grammar():
            raise ValueError(
                "constraining the output (response_format json_schema / json_object, or a "
                "grammar) together with tools is not supported; use tool_choice 'none' or drop "
                "one of them"
            )
        return self

    @property
    def uses_tools(self) -> bool:
        """Tools are offered to the model (given, and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function tool_choice names, or "" for "required" (any), None when not forced."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them, None when none are offered."""
        if not self.uses_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_names(self) -> frozenset[str] | None:
        """The names of the functions offered, None when none are offered."""
        if not self.uses_tools:
            return None
        return frozenset(t.function.name for t in self.tools or [])

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
    # images (URLs or data: URIs): one or a list for one prompt; for a batch, one entry per
    # prompt (a URL, a list, or null)
    image_data: str | list[str | list[str] | None] | None = None

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
