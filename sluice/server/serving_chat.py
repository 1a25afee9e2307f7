"""POST /v1/chat/completions: ChatCompletionRequest → GenerateReqInput, and back to OpenAI.

Streaming shape per choice: a role chunk (`{"role": "assistant", "content": ""}`), content
chunks, then one chunk with an empty delta and the finish_reason; `finish_reason` is null on
every other chunk.
"""

from __future__ import annotations

from typing import Any

from sluice.server.errors import APIError
from sluice.server.logprobs import chat_logprobs
from sluice.server.protocol import ChatCompletionRequest
from sluice.server.serving_base import OpenAIServingBase, ResponseState, finish_reason, new_rid
from sluice.server.sse import sse_data
from sluice.tokenizer.generate_input import GenerateReqInput

CHUNK = "chat.completion.chunk"


class OpenAIServingChat(OpenAIServingBase):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl-"

    async def convert(self, req: ChatCompletionRequest) -> GenerateReqInput:
        try:
            messages = req.template_messages()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error", "messages") from None
        tools = None if req.tool_choice == "none" else req.tools
        text = self.tm.apply_chat_template(
            messages,
            tools=tools,
            chat_template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
        )
        # the template already holds the special tokens (BOS, role markers): add none again
        input_ids = await self.tm.tokenize(text, add_special_tokens=False)
        return GenerateReqInput(
            input_ids=input_ids,
            sampling_params=req.sampling_params(),
            rid=req.rid or new_rid(),
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            stream=req.stream,
            timeout=req.timeout or 0.0,
            session_params=req.session_params,
        )

    def new_state(self, req: ChatCompletionRequest, obj: GenerateReqInput) -> ResponseState:
        state = super().new_state(req, obj)
        state.extra["logprobs"] = req.logprobs
        return state

    def _logprobs(self, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
        pairs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        return chat_logprobs(self.ctx.token_text, pairs[start:], tops[start:])

    def stream_frames(self, state: ResponseState, item: dict[str, Any]) -> list[str]:
        index, meta = item["index"], item["meta_info"]
        frames = []
        if index not in state.started:
            state.started.add(index)
            frames.append(self._chunk(state, index, {"role": "assistant", "content": ""}))
        logprobs = None
        if state.extra["logprobs"] and item.get("new_logprob_count"):
            num_seen = len(meta.get("output_token_logprobs") or []) - item["new_logprob_count"]
            logprobs = self._logprobs(meta, num_seen)
        if item["delta"] or logprobs is not None:
            frames.append(self._chunk(state, index, {"content": item["delta"]}, logprobs=logprobs))
        reason = finish_reason(meta)
        if reason is not None:
            matched = meta["finish_reason"].get("matched")
            frames.append(self._chunk(state, index, {}, reason=reason, matched=matched))
        return frames

    def _chunk(
        self,
        state: ResponseState,
        index: int,
        delta: dict[str, Any],
        *,
        logprobs: dict[str, Any] | None = None,
        reason: str | None = None,
        matched: int | str | None = None,
    ) -> str:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        if reason is not None:
            choice["matched_stop"] = matched
        body = self.chunk_head(state, CHUNK)
        body["choices"] = [choice]
        if state.include_usage:
            body["usage"] = None
        return sse_data(body)

    def usage_chunk(self, state: ResponseState, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.chunk_head(state, CHUNK), "choices": [], "usage": usage}

    def final_response(self, state: ResponseState, items: list[dict[str, Any]]) -> dict[str, Any]:
        choices = [self._choice(state, item) for item in items]
        return {
            **self.chunk_head(state, "chat.completion"),
            "choices": choices,
            "usage": state.usage(),
        }

    def _choice(self, state: ResponseState, item: dict[str, Any]) -> dict[str, Any]:
        meta = item["meta_info"]
        reason = finish_reason(meta)
        return {
            "index": item["index"],
            "message": {"role": "assistant", "content": item["text"]},
            "logprobs": self._logprobs(meta) if state.extra["logprobs"] else None,
            "finish_reason": reason,
            "matched_stop": (meta.get("finish_reason") or {}).get("matched"),
        }
