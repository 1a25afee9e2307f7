"""Chat messages → prompt text, through the tokenizer's own chat template.

Text-only models: a message's `content` is a string, None, or a list of parts where every part
is `{"type": "text", "text": ...}`; the parts are joined with newlines. Any other part, a
missing template or a template that fails (jinja errors, `raise_exception` in the template) is
the client's problem: a 400 RequestError.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.tokenizer.normalize import RequestError

logger = logging.getLogger(__name__)

# apply_chat_template arguments that chat_template_kwargs may not override
_RESERVED_KWARGS = frozenset(
    {"conversation", "tools", "tokenize", "return_dict", "return_tensors", "add_generation_prompt"}
)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use the completions API instead")
    conversation = normalize_messages(messages)
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs"
        )
    try:
        prompt = tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as e:  # template code runs on client data: any failure is a bad request
        logger.debug("chat template failed", exc_info=True)
        raise RequestError(f"the chat template could not be applied: {e}", param="messages") from e
    if not isinstance(prompt, str):
        raise RequestError("the chat template did not produce text", param="messages")
    return prompt


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of `messages` with text-only content (the caller's dicts are not changed)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RequestError(
                f"messages[{i}] must be an object with a string role", param=f"messages[{i}]"
            )
        out.append({**msg, "content": _text_content(msg.get("content"), i)})
    return out


def _text_content(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    param = f"messages[{i}].content"
    if not isinstance(content, list):
        raise RequestError("content must be a string or a list of parts", param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                f"content part of type {kind!r} is not supported by this text-only model",
                param=param,
            )
        texts.append(part["text"])
    return "\n".join(texts)
