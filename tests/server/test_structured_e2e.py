"""Structured output through the real server: OpenAI's `response_format`, SGLang's and vLLM's
grammar fields, the `openai` SDK's `parse` helper, and the 400s of grammars that cannot be had.

The default model (SmolLM2-135M) in float32; every finished output is checked with
`jsonschema` or `re.fullmatch`, and the server is idle with nothing left behind at the end.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from tests.server.live_server import LiveServer, assert_no_state_left

openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person who lives in a big city, as JSON."}]


@pytest.fixture(scope="module")
def live(default_chat: LiveServer) -> LiveServer:
    return default_chat


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key="none", max_retries=0)


def _schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_chat_validates_and_streams_the_same(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 120,
          "response_format": _schema_format(PERSON)}  # fmt: skip
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop"
    jsonschema.validate(json.loads(full.message.content), PERSON)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampled_outputs_with_n_all_validate(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.0, seed=7, n=4, max_tokens=120,
        response_format=_schema_format(PERSON),
    )  # fmt: skip
    assert len(resp.choices) == 4
    for choice in resp.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        else:
            assert choice.finish_reason == "length"
    assert sum(c.finish_reason == "stop" for c in resp.choices) >= 2


class Event(BaseModel):
    title: str
    day: int
    attendees: list[str]


def test_openai_sdk_parse_returns_the_object(client: openai.OpenAI) -> None:
    """The SDK turns a pydantic model into a strict json_schema and parses the reply back."""
    resp = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=150, response_format=Event,
        messages=[{"role": "user", "content": "A team meeting on day 3 with Ann and Bob."}],
    )  # fmt: skip
    event = resp.choices[0].message.parsed
    assert isinstance(event, Event)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=120,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"  # greedy, it closes its object well before
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_completions_take_response_format_and_grammar_fields(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Today's date in ISO format:", temperature=0, max_tokens=20,
        extra_body={"response_format": _schema_format({"type": "string", "format": "date"})},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    assert re.fullmatch(r'"\d{4}-\d{2}-\d{2}"', resp.choices[0].text)
    for extra in ({"regex": "(yes|no)"}, {"guided_choice": ["yes", "no"]}):
        resp = client.completions.create(
            model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=5, temperature=0,
            extra_body=extra,
        )  # fmt: skip
        assert resp.choices[0].text in ("yes", "no") and resp.choices[0].finish_reason == "stop"


def test_native_generate_takes_regex_and_ebnf(live: LiveServer) -> None:
    for params, pattern in (
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
        ({"ebnf": 'start: "color: " ("red" | "green" | "blue")'}, r"color: (red|green|blue)"),
        ({"ebnf": 'root ::= "n=" [0-9] [0-9]? "."'}, r"n=[0-9]{1,2}\."),  # GBNF
    ):
        body = {
            "text": "Answer:",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, **params},
        }
        out = httpx.post(f"{live.base}/generate", json=body, timeout=60).json()
        assert re.fullmatch(pattern, out["text"]), (params, out["text"])


@pytest.mark.parametrize("stream", [False, True])
def test_bad_grammars_are_400(client: openai.OpenAI, stream: bool) -> None:
    cases = [
        ({"response_format": _schema_format({"type": "objectx"})}, "json_schema"),
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"extra_body": {"regex": "(("}}, "regex"),
        ({"extra_body": {"regex": "a", "guided_json": {}}}, "regex and guided_json"),
    ]
    for kw, named in cases:
        with pytest.raises(openai.BadRequestError) as info:
            resp = client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=8, stream=stream, **kw
            )
            list(resp) if stream else None
        assert named in info.value.message, (kw, info.value.message)


@pytest.mark.parametrize("stream", [False, True])
def test_native_generate_answers_a_bad_grammar_with_400(live: LiveServer, stream: bool) -> None:
    body = {"text": "x", "stream": stream, "sampling_params": {"regex": "((", "max_new_tokens": 4}}
    resp = httpx.post(f"{live.base}/generate", json=body, timeout=60)
    assert resp.status_code == 400 and "regex" in resp.json()["error"]["message"]


def test_zz_nothing_left_behind(live: LiveServer) -> None:
    state = live.wait_idle()
    assert_no_state_left(state)
    assert state["num_grammar_reqs"] == 0
