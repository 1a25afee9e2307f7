"""Grammars that force a tool call (`tool_choice` "required" or a named function), per family.

The grammar is Lark in llguidance's dialect (sent to the scheduler as `ebnf`): the family's call
markers as literals, each call's JSON as `%json {schema}`, where the schema pins `name` to one
of the offered functions (`const`) and its arguments to that function's `parameters` (with no
arguments beyond the declared ones, unless the schema says otherwise). So a forced call is
always one the parser of the same family reads back, with valid arguments.
A marker that is a special token of the tokenizer (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`) is written as that token (`<[id]>`), since the model emits it as one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

WHITESPACE = r"[\x20\x0A\x0D\x09]{1,24}"
MAX_PARALLEL_CALLS = 16  # calls one forced turn may hold when parallel calls are allowed
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(
    tools: list[dict[str, Any]], forced: str, args_key: str = "arguments"
) -> dict[str, Any]:
    """A JSON schema of one call: {"name": <const>, args_key: <parameters>} for the function
    named `forced`, or any offered function when `forced` is "". Each function's `$defs`
    (and `definitions`) move to the root, renamed after the function, with its `$ref`s
    rewritten: nested under `arguments`, the references would point nowhere."""
    options = []
    defs: dict[str, Any] = {}
    for tool in tools:
        fn = tool["function"]
        if forced and fn["name"] != forced:
            continue
        params, own_defs = _hoist_defs(fn.get("parameters") or ANY_OBJECT, fn["name"])
        defs.update(own_defs)
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    args_key: _closed(params),
                },
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    # whitespace runs bounded as in response_format (scheduler/grammar.py JSON_OPTIONS)
    return {**schema, "x-guidance": {"whitespace_pattern": WHITESPACE}}


def _hoist_defs(params: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`params` without its `$defs`/`definitions`, its local `$ref`s pointing at
    `#/$defs/<prefix>__<name>`; and those definitions under their new names."""
    params = dict(params)
    found = {**params.pop("definitions", {}), **params.pop("$defs", {})}
    if not found:
        return params, {}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for base in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(base):
                        out["$ref"] = f"#/$defs/{prefix}__{ref[len(base) :]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    return rewrite(params), {f"{prefix}__{k}": rewrite(v) for k, v in found.items()}


def _closed(params: dict[str, Any]) -> dict[str, Any]:
    """An object schema without `additionalProperties` gets false: a forced call carries the
    declared arguments only (small models invent others), as under OpenAI's strict mode."""
    if params.get("type") == "object" and "properties" in params:
        return {"additionalProperties": False, **params}
    return params


def forced_call_grammar(
    family: str,
    tools: list[dict[str, Any]],
    forced: str,
    parallel: bool,
    special_id: Callable[[str], int | None] = lambda _: None,
) -> str:
    """The Lark grammar of a turn that is only tool calls of `family`'s format: one call when
    a function is named or parallel calls are off, else one to MAX_PARALLEL_CALLS."""
    more = "" if forced or not parallel else f"{{0,{MAX_PARALLEL_CALLS - 1}}}"

    def lit(marker: str) -> str:
        token = special_id(marker)
        return json.dumps(marker) if token is None else f"<[{token}]>"

    if family == "llama3":
        schema = json.dumps(call_schema(tools, forced, "parameters"))
        rest = f' (";" call){more}' if more else ""
        return f"start: {lit('<|python_tag|>')}? call{rest}\ncall: %json {schema}\n"
    if family == "mistral":
        call = call_schema(tools, forced)
        extra = {k: call.pop(k) for k in ("$defs", "x-guidance") if k in call}
        array = {"type": "array", "items": call, "minItems": 1, **extra}
        array["maxItems"] = MAX_PARALLEL_CALLS if more else 1
        return f"start: {lit('[TOOL_CALLS]')} calls\ncalls: %json {json.dumps(array)}\n"
    schema = json.dumps(call_schema(tools, forced))
    rest = f' ("\\n" call){more}' if more else ""
    return (
        f"start: call{rest}\n"
        f'call: {lit("<tool_call>")} "\\n" body "\\n" {lit("</tool_call>")}\n'
        f"body: %json {schema}\n"
    )
