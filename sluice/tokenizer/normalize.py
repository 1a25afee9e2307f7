"""GenerateReqInput → one `Item` per (prompt, sample), with validated sampling parameters.

Everything here is pure (no tokenizer, no I/O); every rejection is a `RequestError` whose
`param` names the offending field, so the HTTP layer can answer with an OpenAI error body.
Item order: index = prompt_index * n + sample_index.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from sluice.messages import SamplingParams
from sluice.tokenizer.generate_input import GenerateReqInput

SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__) | {"n"}
MAX_N = 128
# The wire to the scheduler (msgpack) carries integers in [-2**63, 2**64 - 1] and fails on any
# other. Every integer a request carries is bounded to the range it means, always inside int64,
# before it is sent: `int_range_problem` is the one check (the HTTP models use it too).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# integer sampling fields -> (lowest, highest) accepted
_INT_RANGES: dict[str, tuple[int, int]] = {
    "max_new_tokens": (0, INT64_MAX),
    "min_new_tokens": (0, INT64_MAX),
    "top_k": (-1, INT64_MAX),
    "seed": (INT64_MIN, INT64_MAX),
}
# float sampling fields -> (lowest, highest) accepted; None: unbounded on that side
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0.0, None),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}


def int_range_problem(value: Any, lo: int, hi: int) -> str | None:
    """None when `value` is an integer (not a bool) in [lo, hi]; else what is wrong with it."""
    if type(value) is int and lo <= value <= hi:
        return None
    if isinstance(value, int) and value.bit_length() > 128:
        text = f"an integer of {value.bit_length()} bits"  # (too long to quote)
    else:
        text = repr(value)
        text = text if len(text) <= 40 else f"{text[:40]}..."
    return f"must be an integer in [{lo}, {hi}], got {text}"


def check_int(
    name: str, value: Any, lo: int = INT64_MIN, hi: int = INT64_MAX, param: str | None = None
) -> int:
    """`value`, if it is an integer in [lo, hi]; else a RequestError naming `name` and the range
    (`param`: the field, when `name` is a part of it)."""
    problem = int_range_problem(value, lo, hi)
    if problem is not None:
        raise RequestError(f"{name} {problem}", param=param or name)
    return value


def wrap_int64(value: int) -> int:
    """`value` wrapped into int64 (two's complement): the same 64 bits a seed is hashed from."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


class RequestError(Exception):
    """A request the server will not run; maps to an OpenAI error body with `status_code`."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        code: str | None = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param


RETRY_AFTER_S = 1  # the Retry-After of a 429


def queue_full_error(
    in_flight: int, num_new: int, max_running: int, max_queued: int
) -> RequestError | None:
    """The 429 (`queue_full`, with Retry-After) for `num_new` more requests when that would pass
    `max_running` running plus `max_queued` queued; None when they fit, when there is no limit,
    or when nothing is in flight (a call larger than the whole queue still runs, alone)."""
    if max_queued <= 0 or in_flight == 0 or in_flight + num_new <= max_running + max_queued:
        return None
    err = RequestError(
        f"the server is at capacity ({in_flight} requests in flight, up to {max_running} "
        f"running and {max_queued} queued); retry later",
        status_code=429, code="queue_full",
    )  # fmt: skip
    err.headers = {"Retry-After": str(RETRY_AFTER_S)}  # type: ignore[attr-defined]
    return err


@dataclass
class Item:
    """One (prompt, sample) of a GenerateReqInput; `prompt` is text or token ids."""

    index: int
    prompt_index: int
    rid: str
    prompt: str | list[int]
    params: SamplingParams


def normalize(obj: GenerateReqInput) -> list[Item]:
    prompts = _prompts(obj)
    param_dicts = _param_dicts(obj.sampling_params, len(prompts))
    parsed = [parse_sampling_params(p) for p in param_dicts]
    n = parsed[0][1]
    if any(pn != n for _, pn in parsed):
        raise RequestError("every prompt of a batch must ask for the same n", param="n")
    rids = _rids(obj.rid, len(prompts), n)
    items = []
    for p, (prompt, (params, _)) in enumerate(zip(prompts, parsed, strict=True)):
        for s in range(n):
            sample = params if s == 0 else msgspec.structs.replace(params)
            if s > 0 and params.seed is not None:  # distinct, still reproducible, samples
                sample.seed = wrap_int64(params.seed + s)
            index = p * n + s
            items.append(Item(index, p, rids[index], prompt, sample))
    check_int("top_logprobs_num", obj.top_logprobs_num, 0)
    check_int("logprob_start_len", obj.logprob_start_len, -1)
    if obj.session_params is not None:
        _check_session_request(obj, len(items))
    return items


def _check_session_request(obj: GenerateReqInput, num_items: int) -> None:
    """A session turn is one prompt and one sample; the prompt the scheduler builds is not the
    one sent, so prompt logprobs (positions of the sent prompt) cannot be given."""
    if num_items > 1:
        raise RequestError("session_params need a single prompt and n = 1", param="session_params")
    if obj.return_logprob and obj.logprob_start_len >= 0:
        raise RequestError(
            "prompt logprobs (logprob_start_len >= 0) are not available for a session turn",
            param="logprob_start_len",
        )


def _prompts(obj: GenerateReqInput) -> list[str | list[int]]:
    if (obj.text is None) == (obj.input_ids is None):
        raise RequestError("give exactly one of text and input_ids", param="text")
    if obj.is_single:
        if obj.text is not None:
            return [obj.text]
        if not all(type(t) is int for t in obj.input_ids or []):
            raise RequestError("input_ids must hold integer token ids", param="input_ids")
        return [list(obj.input_ids or [])]
    if obj.text is not None:
        if not isinstance(obj.text, list) or not all(isinstance(t, str) for t in obj.text):
            raise RequestError("text must be a string or a list of strings", param="text")
        prompts: list[Any] = list(obj.text)
    else:
        prompts = list(obj.input_ids or [])
        for ids in prompts:
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise RequestError(
                    "input_ids must be a list of token ids or a list of such lists",
                    param="input_ids",
                )
    if not prompts:
        raise RequestError("the batch of prompts is empty", param=_prompt_param(obj))
    return prompts


def _prompt_param(obj: GenerateReqInput) -> str:
    return "text" if obj.text is not None else "input_ids"


def _param_dicts(params: Any, num_prompts: int) -> list[dict[str, Any]]:
    if params is None:
        return [{}] * num_prompts
    if isinstance(params, dict):
        return [params] * num_prompts
    if isinstance(params, list) and len(params) == num_prompts:
        if all(isinstance(p, dict) for p in params):
            return params
    raise RequestError(
        f"sampling_params must be one object or a list of {num_prompts} (one per prompt)",
        param="sampling_params",
    )


def parse_sampling_params(params: dict[str, Any]) -> tuple[SamplingParams, int]:
    """(SamplingParams, n) from a plain dict; unknown keys, wrong types and ranges are errors."""
    params = dict(params)
    unknown = sorted(set(params) - SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"unknown sampling parameter {unknown[0]!r}", param=unknown[0])
    n = params.pop("n", 1)
    n = check_int("n", 1 if n is None else n, 1, MAX_N)
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    if params.get("stop") is None:
        params.pop("stop", None)
    check_grammar(params)
    try:
        if params.get("logit_bias"):
            params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
        sp = msgspec.convert(params, SamplingParams, strict=False)
    except (msgspec.ValidationError, ValueError, TypeError, AttributeError) as e:
        raise RequestError(f"invalid sampling parameters: {e}", param=_error_param(e)) from e
    _check_ranges(sp)
    return sp, n


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


def check_grammar(params: dict[str, Any]) -> None:
    """At most one grammar; a JSON schema given as an object becomes its JSON text, and JSON
    text must parse (the schema itself is checked when the scheduler compiles it)."""
    given = [k for k in GRAMMAR_FIELDS if params.get(k) is not None]
    if len(given) > 1:
        raise RequestError(
            f"give at most one of json_schema, regex and ebnf; got {' and '.join(given)}",
            param=given[1],
        )
    schema = params.get("json_schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(f"json_schema is not valid JSON: {e}", param="json_schema") from e
    if schema is False:
        raise RequestError("json_schema false matches nothing", param="json_schema")
    if schema is True:  # any JSON value
        params["json_schema"] = "{}"
    elif isinstance(schema, dict):
        params["json_schema"] = json.dumps(schema)


def _error_param(e: Exception) -> str | None:
    m = re.search(r"at `\$\.(\w+)", str(e))
    if m:
        return m.group(1)
    return "logit_bias" if "int()" in str(e) or "float()" in str(e) else None


def _check_ranges(sp: SamplingParams) -> None:
    for name, (ilo, ihi) in _INT_RANGES.items():
        if getattr(sp, name) is not None:
            check_int(name, getattr(sp, name), ilo, ihi)
    for token in sp.stop_token_ids:
        check_int("a stop_token_ids entry (a token id)", token, 0, param="stop_token_ids")
    for token in sp.logit_bias or {}:
        check_int("a logit_bias key (a token id)", token, 0, param="logit_bias")
    for name, (lo, hi) in _RANGES.items():
        value = getattr(sp, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}", param=name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise RequestError(f"{name} must be {bounds}, got {value}", param=name)
    if sp.repetition_penalty == 0.0:
        raise RequestError("repetition_penalty must be > 0", param="repetition_penalty")
    if sp.top_k != -1 and sp.top_k < 1:
        raise RequestError(f"top_k must be -1 (no limit) or >= 1, got {sp.top_k}", param="top_k")
    if sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens:
        raise RequestError(
            f"min_new_tokens ({sp.min_new_tokens}) exceeds max_new_tokens ({sp.max_new_tokens})",
            param="min_new_tokens",
        )
    for token, bias in (sp.logit_bias or {}).items():
        if not -100.0 <= bias <= 100.0:
            raise RequestError(
                f"logit_bias of token {token} must be in [-100, 100], got {bias}",
                param="logit_bias",
            )


def _rids(rid: Any, num_prompts: int, n: int) -> list[str]:
    total = num_prompts * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        rids = [rid] if total == 1 else [f"{rid}-{i}" for i in range(total)]
    elif isinstance(rid, list) and len(rid) == num_prompts and all(isinstance(r, str) for r in rid):
        rids = list(rid) if n == 1 else [f"{r}-{s}" for r in rid for s in range(n)]
    else:
        raise RequestError(
            f"rid must be a string or a list of {num_prompts} strings (one per prompt)",
            param="rid",
        )
    if len(set(rids)) != len(rids) or not all(rids):
        raise RequestError("request ids must be distinct and non-empty", param="rid")
    return rids
