"""Chat messages → prompt text, through the tokenizer's own chat template.

A message's `content` is a string, None, or a list of parts, each `{"type": "text", "text": ...}`
or, for a vision-language model, `{"type": "image_url", "image_url": {"url": ...}}`; the parts
are joined with newlines, an image part as the model's image token (`image_token`, e.g.
`<image>`) at its place, so that any text template renders it and the prompt names the images
in the order `image_urls` lists them. Any other part, an image for a text-only model, a missing
template or a template that fails (jinja errors, `raise_exception` in the template) is the
client's problem: a 400 RequestError.

Tool turns are normalized so that every template finds the fields it reads: content None is ""
(templates concatenate it; transformers would otherwise drop the key), an assistant's
`tool_calls` have `function.arguments` as an object (templates `tojson` or iterate it; a
template that concatenates it as text is retried with the JSON text), a `tool` message keeps
its `tool_call_id` and gets the `name` of the call it answers when it has none.

A template that does not mention `tools` (e.g. SmolLM2's plain ChatML) gets the tools as text:
a system prompt listing them and asking for hermes-style `<tool_call>` blocks, earlier calls as
those blocks in the assistant's content, and tool results as a user turn of
`<tool_response>` blocks; the "hermes" tool parser reads the answer.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any

from sluice.tokenizer.normalize import RequestError

logger = logging.getLogger(__name__)

# apply_chat_template arguments that chat_template_kwargs may not override
_RESERVED_KWARGS = frozenset(
    {"conversation", "tools", "tokenize", "return_dict", "return_tensors", "add_generation_prompt"}
)

_TOOLS_WORD = re.compile(r"\btools\b")

_TOOLS_PROMPT = (
    "You can call tools (functions) to answer. The tools, one JSON object each:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a tool, reply with one block per call, exactly in this form:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>\n'
    "Each tool's result comes back inside <tool_response></tool_response> tags."
)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    image_token: str | None = None,
) -> str:
    """`image_token`: what an image part becomes; None: the model takes text only."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use the completions API instead")
    conversation = normalize_messages(messages, image_token)
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs"
        )
    tools = [_plain_tool(t) for t in tools] if tools else None
    if not template_supports_tools(_template_text(tokenizer, tools)):
        conversation, tools = tools_as_text(conversation, tools), None
    prompt = _render(tokenizer, conversation, tools, kwargs, add_generation_prompt)
    if not isinstance(prompt, str):
        raise RequestError("the chat template did not produce text", param="messages")
    return prompt


def _render(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    tools: list | None,
    kwargs: dict[str, Any],
    add_generation_prompt: bool,
) -> Any:
    """The template's output; a template that fails on arguments objects is retried with the
    arguments as JSON text (templates that concatenate them)."""
    attempts = [conversation]
    if any(m.get("tool_calls") for m in conversation):
        attempts.append(_with_text_arguments(conversation))
    errors: list[Exception] = []
    for attempt in attempts:
        try:
            return tokenizer.apply_chat_template(
                attempt,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as e:  # template code runs on client data: any failure is a bad request
            logger.debug("chat template failed", exc_info=True)
            errors.append(e)
    raise RequestError(
        f"the chat template could not be applied: {errors[0]}", param="messages"
    ) from errors[0]


def _plain_tool(tool: Any) -> Any:
    """A tool as a plain dict (request models are dumped), what templates and JSON take."""
    dump = getattr(tool, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else tool


def _template_text(tokenizer: Any, tools: list | None) -> str:
    """The template transformers would pick for this request (a tokenizer may have several)."""
    try:
        return tokenizer.get_chat_template(None, tools)
    except Exception:  # an older or foreign tokenizer: its one template
        template = getattr(tokenizer, "chat_template", None)
        return template if isinstance(template, str) else ""


_PARAMETERS_KEY = re.compile(r'\\?"parameters\\?"')  # the key, maybe escaped in a template string


def detect_parser(chat_template: str | None) -> str | None:
    """The family whose tool-call format `chat_template` teaches; None when it has none."""
    if not chat_template:
        return None
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    llama3_json = _PARAMETERS_KEY.search(chat_template) and "<|start_header_id|>" in chat_template
    if "<|python_tag|>" in chat_template or llama3_json:
        return "llama3"
    return None


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders tool definitions (it reads the `tools` variable) in a
    format sluice parses back; other templates get sluice's own tool prompt instead, so the
    prompt and the parser agree."""
    return (
        bool(chat_template)
        and _TOOLS_WORD.search(chat_template) is not None
        and detect_parser(chat_template) is not None
    )


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URLs of the image parts of `messages`, in order."""
    urls = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                urls.append(image.get("url") if isinstance(image, dict) else image)
    return urls


def normalize_messages(messages: Any, image_token: str | None = None) -> list[dict[str, Any]]:
    """Copies of `messages` with text content ("" for None; image parts as `image_token`) and
    tool turns normalized (see the module docstring); the caller's dicts are not changed."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    out = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, from earlier calls
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RequestError(
                f"messages[{i}] must be an object with a string role", param=f"messages[{i}]"
            )
        norm = {**msg, "content": _text_content(msg.get("content"), i, image_token) or ""}
        norm.pop("tool_calls", None)
        if msg.get("tool_calls"):
            norm["tool_calls"] = _tool_calls(msg["tool_calls"], i)
            call_names.update((c["id"], c["function"]["name"]) for c in norm["tool_calls"])
        if norm["role"] == "tool" and not norm.get("name"):
            name = call_names.get(str(norm.get("tool_call_id")))
            if name:
                norm["name"] = name
        out.append(norm)
    return out


def _text_content(content: Any, i: int, image_token: str | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    param = f"messages[{i}].content"
    if not isinstance(content, list):
        raise RequestError("content must be a string or a list of parts", param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            if image_token is None:
                raise RequestError(
                    "content part of type 'image_url': this model accepts text only", param=param
                )
            texts.append(image_token)
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            takes = "text parts only" if image_token is None else "text and image_url parts"
            raise RequestError(
                f"content part of type {kind!r} is not supported: this model takes {takes}",
                param=param,
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """Copies of an assistant's tool calls, each `function.arguments` an object when its text
    is a JSON object (other text is kept as it is)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError("tool_calls must be a list", param=param)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError("each tool call needs a function with a string name", param=param)
        args = function.get("arguments")
        if isinstance(args, str):
            parsed = _json_object(args)
            args = args if parsed is None else parsed
        elif args is None:
            args = {}
        out.append(
            {
                **copy.deepcopy(call),
                "id": call.get("id") or "",
                "type": call.get("type") or "function",
                "function": {**copy.deepcopy(function), "arguments": args},
            }
        )
    return out


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _with_text_arguments(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every tool call's arguments as JSON text."""
    out = []
    for msg in conversation:
        if msg.get("tool_calls"):
            msg = {**msg, "tool_calls": [_call_with_text_arguments(c) for c in msg["tool_calls"]]}
        out.append(msg)
    return out


def _call_with_text_arguments(call: dict[str, Any]) -> dict[str, Any]:
    args = call["function"]["arguments"]
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": text}}


def tools_as_text(conversation: list[dict[str, Any]], tools: list | None) -> list[dict[str, Any]]:
    """A normalized conversation for a template without tool support: tools in the system
    prompt, calls and results as hermes-style text in plain assistant and user turns
    (consecutive tool results share one user turn)."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for msg in conversation:
        if msg["role"] == "tool":
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        if msg.get("tool_calls"):
            msg = _calls_as_text(msg)
        out.append(msg)
    if tools:
        out = _with_tools_prompt(out, tools)
    return out


def _calls_as_text(msg: dict[str, Any]) -> dict[str, Any]:
    blocks = []
    for call in msg["tool_calls"]:
        name, args = call["function"]["name"], call["function"]["arguments"]
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    text = "\n".join(blocks)
    rest = {k: v for k, v in msg.items() if k != "tool_calls"}
    return {**rest, "content": f"{msg['content']}\n{text}" if msg["content"] else text}


def _with_tools_prompt(conversation: list[dict[str, Any]], tools: list) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = _TOOLS_PROMPT.format(tools=listing)
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        system = {
            **first,
            "content": f"{prompt}\n\n{first['content']}" if first["content"] else prompt,
        }
        return [system, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]
