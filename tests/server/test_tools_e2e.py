"""Tool calls through the real server and the `openai` SDK, on the default model.

SmolLM2's chat template does not render tools, so sluice's fallback prompt asks for hermes-style
`<tool_call>` blocks; `tool_choice` "required" and named functions are enforced by a grammar, so
the calls are there and their arguments follow the function's schema whatever the model's skill.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.server.live_server import LiveServer, assert_no_state_left

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def live(default_chat: LiveServer) -> LiveServer:
    return default_chat


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key="none", max_retries=0)


def _create(client: openai.OpenAI, **kw):
    base = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 120}
    return client.chat.completions.create(**{**base, **kw})


def _check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_gives_a_valid_call(client: openai.OpenAI) -> None:
    choice = _create(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _create(client, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _check_call(choice.message.tool_calls[0], "get_time")


def test_streamed_call_deltas_reassemble(client: openai.OpenAI) -> None:
    kw = {"tool_choice": "required", "parallel_tool_calls": False}
    full = _create(client, **kw).choices[0].message.tool_calls[0]
    chunks = list(_create(client, stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", full.function.name, ""
    )  # fmt: skip
    assert first.id and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == full.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_a_tool_result_continues(client: openai.OpenAI) -> None:
    call = _create(client, tool_choice="required", parallel_tool_calls=False)
    call = call.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    resp = _create(client, messages=messages, tool_choice="none", max_tokens=30)
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tool_choice_none_and_auto_answer_as_text_or_calls(client: openai.OpenAI) -> None:
    plain = _create(client, tool_choice="none", max_tokens=20).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason in ("stop", "length")
    auto = _create(client, max_tokens=120).choices[0]  # the model's choice: either is fine
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        for call in auto.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert auto.message.content


def test_tool_requests_that_cannot_be_honoured_are_400(client: openai.OpenAI) -> None:
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        ({"response_format": {"type": "json_object"}}, "together with tools"),
        ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]}, "strict"),
    ]
    for kw, named in bad:
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, **kw)
        assert named in info.value.message


class Weather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def _chat_openai(live: LiveServer) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{live.base}/v1", api_key="none", model=MODEL, temperature=0, max_tokens=120,
        max_retries=0,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(live: LiveServer, method: str) -> None:
    pytest.importorskip("langchain_openai")
    llm = _chat_openai(live).with_structured_output(Weather, method=method)
    result = llm.invoke("What is the weather like in Paris right now?")
    assert isinstance(result, Weather)


def test_langchain_bind_tools_returns_calls(live: LiveServer) -> None:
    pytest.importorskip("langchain_openai")
    llm = _chat_openai(live).bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)
    message = llm.invoke("What is the weather like in Paris right now?")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    home: Address


def test_a_forced_strict_tool_with_nested_models(client: openai.OpenAI) -> None:
    """The SDK's pydantic tool: strict, parameters with $defs and $ref; named, it is forced."""
    tool = openai.pydantic_function_tool(Person)
    choice = _create(
        client, tools=[tool], tool_choice={"type": "function", "function": {"name": "Person"}},
        messages=[{"role": "user", "content": "Ann lives in Lyon, France."}],
    ).choices[0]  # fmt: skip
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    Person.model_validate(args)
    assert choice.finish_reason == "tool_calls"


def test_zz_nothing_left_behind(live: LiveServer) -> None:
    state = live.wait_idle()
    assert_no_state_left(state)
