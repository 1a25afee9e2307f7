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

MAX_PARALLEL_CALLS = 16  # calls one forced turn may hold when parallel calls are allowed
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(
    tools: list[dict[str, Any]], forced: str, args_key: str = "arguments"
) -> dict[str, Any]:
    """A JSON schema of one call: {"name": <const>, args_key: <parameters>} for the function
    named `forced`, or any offered function when `forced` is ""."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if forced and fn["name"] != forced:
            continue
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    args_key: _closed(fn.get("parameters") or ANY_OBJECT),
                },
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


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
        array = {"type": "array", "items": call_schema(tools, forced), "minItems": 1}
        array["maxItems"] = MAX_PARALLEL_CALLS if more else 1
        return f"start: {lit('[TOOL_CALLS]')} calls\ncalls: %json {json.dumps(array)}\n"
    schema = json.dumps(call_schema(tools, forced))
    rest = f' ("\\n" call){more}' if more else ""
    return (
        f"start: call{rest}\n"
        f'call: {lit("<tool_call>")} "\\n" body "\\n" {lit("</tool_call>")}\n'
        f"body: %json {schema}\n"
    )
