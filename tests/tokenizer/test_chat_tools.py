"""Tool turns through real chat templates: SmolLM2's (no tool support: the hermes fallback) and
hand-written templates in the style of Qwen2.5, Llama 3.1, Mistral and DeepSeek."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from sluice.server.tool_parser import PARSERS
from sluice.tokenizer.chat import apply_chat_template, normalize_messages, template_supports_tools
from sluice.tokenizer.normalize import RequestError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_ID = "abc123XYZ"  # 9 alphanumerics: Mistral's templates insist
ARGS = '{"city": "Paris", "unit": "°C"}'
RESULT = '{"temp": 21}'


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": CALL_ID,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        {"role": "user", "content": "And Rome?"},
    ]


QWEN_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall one with <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>' }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_STYLE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
{{- 'Environment: ipython\\nAnswer with {"name": function name, "parameters": arguments}.\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{{- message.content | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}
{{- tool_call.arguments | tojson }}
{{- '}<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping %}{{- message.content | tojson }}
{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL_STYLE = """\
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message['role'] == 'user' %}
{%- if tools is not none and message == user_messages[-1] %}
{{- '[AVAILABLE_TOOLS] [' }}
{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}
{{- '][/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if loop.last and system_message is defined %}
{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
{%- else %}
{{- '[INST] ' + message['content'] + '[/INST]' }}
{%- endif %}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- '[TOOL_CALLS] [' }}
{%- for tool_call in message.tool_calls %}
{%- set out = tool_call.function | tojson %}
{{- out[:-1] }}
{%- if not tool_call.id is defined or tool_call.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message['role'] == 'assistant' %}
{%- if message.content is not none %}{{- ' ' + message['content'] | trim + eos_token }}{%- endif %}
{%- elif message['role'] == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', ' }}
{%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('Only user, assistant and tool roles are supported!') }}
{%- endif %}
{%- endfor %}
"""

# concatenates the arguments as text, as DeepSeek's templates do
DEEPSEEK_STYLE = """\
{%- if tools %}{{- 'Tools: ' + (tools | tojson) + '\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for tool in message.tool_calls %}
{{- '<call>' + tool.type + ':' + tool.function.name + '\\n' + tool.function.arguments + '</call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<output>' + message.content + '</output>' }}
{%- else %}
{{- '<' + message.role + '>' + message.content }}
{%- endif %}
{%- endfor %}
"""


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_hf_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_hf_dir)


def with_template(tokenizer: Any, template: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    ("template", "call_text"),
    [
        (QWEN_STYLE, '"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}'),
        (LLAMA31_STYLE, '"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}'),
        (MISTRAL_STYLE, '"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}'),
    ],
    ids=["qwen2.5", "llama3.1", "mistral"],
)
def test_tool_conversation_renders(smollm2_tokenizer: Any, template: str, call_text: str) -> None:
    tok = with_template(smollm2_tokenizer, template)
    assert template_supports_tools(template)
    prompt = apply_chat_template(tok, conversation(), tools=TOOLS)
    assert call_text in prompt
    assert RESULT in prompt
    assert "Current weather for a city" in prompt  # the template rendered the tools itself
    assert "None" not in prompt and "You can call tools" not in prompt  # no fallback


def test_a_template_with_a_tool_format_sluice_does_not_parse_gets_the_tool_prompt(
    smollm2_tokenizer: Any,
) -> None:
    """DeepSeek-style calls (`function:name` and arguments as text) would not be read back:
    the tools go into sluice's own prompt, whose hermes calls the parser reads."""
    assert not template_supports_tools(DEEPSEEK_STYLE)
    prompt = apply_chat_template(
        with_template(smollm2_tokenizer, DEEPSEEK_STYLE), conversation(), tools=TOOLS
    )
    assert "You can call tools" in prompt and "function:get_weather" not in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in prompt


def test_qwen_style_tool_result_is_a_user_turn(smollm2_tokenizer: Any) -> None:
    prompt = apply_chat_template(with_template(smollm2_tokenizer, QWEN_STYLE), conversation())
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>" in prompt
    assert "<|im_start|>assistant\n<tool_call>\n" in prompt


def test_smollm2_fallback_puts_tools_in_the_system_prompt(smollm2_tokenizer: Any) -> None:
    assert not template_supports_tools(smollm2_tokenizer.chat_template)
    prompt = apply_chat_template(smollm2_tokenizer, conversation(), tools=TOOLS)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    assert json.dumps(TOOLS[0]) in system and system.endswith("You are terse.")
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in system
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
    assert f"<|im_start|>assistant\n{call}\n</tool_call><|im_end|>" in prompt
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>" in prompt
    assert "None" not in prompt and "SmolLM" not in prompt  # the template's default system
    assert prompt.endswith("<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_call_text_parses_back_with_hermes(smollm2_tokenizer: Any) -> None:
    prompt = apply_chat_template(smollm2_tokenizer, conversation(), tools=TOOLS)
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, [call] = PARSERS["hermes"]().parse(turn)
    assert content == "" and call.name == "get_weather"
    assert json.loads(call.arguments) == json.loads(ARGS)


def test_fallback_adds_a_system_message_and_merges_tool_results(smollm2_tokenizer: Any) -> None:
    messages = conversation()[1:]
    messages[1]["tool_calls"].append(
        {"id": "x2", "function": {"name": "get_time", "arguments": "{}"}}
    )
    messages.insert(3, {"role": "tool", "tool_call_id": "x2", "content": "noon"})
    prompt = apply_chat_template(smollm2_tokenizer, messages, tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou can call tools")
    assert prompt.count("<|im_start|>user\n<tool_response>") == 1
    assert f"{RESULT}\n</tool_response>\n<tool_response>\nnoon\n</tool_response>" in prompt


def test_fallback_without_tools_still_renders_the_history(smollm2_tokenizer: Any) -> None:
    prompt = apply_chat_template(smollm2_tokenizer, conversation(), tools=None)
    assert "<tools>" not in prompt and "<tool_call>\n" in prompt and RESULT in prompt


def test_normalize_messages_copies_and_fills_tool_fields() -> None:
    messages = conversation()
    before = copy.deepcopy(messages)
    out = normalize_messages(messages)
    assert messages == before
    assert out[2]["content"] == ""
    call = out[2]["tool_calls"][0]
    assert call["function"]["arguments"] == json.loads(ARGS) and call["id"] == CALL_ID
    assert out[3] == {
        "role": "tool",
        "tool_call_id": CALL_ID,
        "content": RESULT,
        "name": "get_weather",
    }


def test_normalize_messages_edge_cases() -> None:
    messages = [
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "nope", "content": [{"type": "text", "text": "r"}]},
    ]
    out = normalize_messages(messages)
    assert "tool_calls" not in out[0]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert out[1]["tool_calls"][0]["type"] == "function"
    assert out[2] == {"role": "tool", "tool_call_id": "nope", "content": "r"}
    with pytest.raises(RequestError):
        normalize_messages([{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}])
    with pytest.raises(RequestError):
        normalize_messages([{"role": "assistant", "tool_calls": "f"}])


def test_template_errors_are_still_bad_requests(smollm2_tokenizer: Any) -> None:
    messages = conversation()
    messages[2]["tool_calls"] *= 2  # the Llama-3.1-style template allows one call per turn
    with pytest.raises(RequestError, match="single tool-calls"):
        apply_chat_template(with_template(smollm2_tokenizer, LLAMA31_STYLE), messages, tools=TOOLS)


def test_tools_may_be_request_models(smollm2_tokenizer: Any) -> None:
    from pydantic import BaseModel

    class Tool(BaseModel):
        type: str
        function: dict[str, Any]
        strict: bool | None = None

    models = [Tool.model_validate(t) for t in TOOLS]
    for template in (None, QWEN_STYLE):
        tok = smollm2_tokenizer if template is None else with_template(smollm2_tokenizer, template)
        expected = apply_chat_template(tok, conversation(), tools=TOOLS)
        assert apply_chat_template(tok, conversation(), tools=models) == expected
