"""POST /v1/completions: CompletionRequest → GenerateReqInput, and back to the legacy shape.

Prompts may be a string, a list of strings, token ids or a list of token-id lists. Choice index
is `prompt_index * n + sample_index`. With `echo`, each choice's text starts with its prompt, and
with `logprobs` too the prompt's logprobs come first (the first prompt token's is null).
"""

from __future__ import annotations

from typing import Any

from sluice.server.errors import APIError, as_api_error
from sluice.server.logprobs import legacy_logprobs, merge_legacy
from sluice.server.protocol import CompletionRequest
from sluice.server.serving_base import OpenAIServingBase, ResponseState, finish_reason, new_rid
from sluice.server.sse import sse_data
from sluice.tokenizer.generate_input import GenerateReqInput

OBJECT = "text_completion"


def _prompt_fields(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt[0], str):
        return {"text": list(prompt)}
    return {"input_ids": [list(p) for p in prompt] if isinstance(prompt[0], list) else list(prompt)}


class OpenAIServingCompletion(OpenAIServingBase):
    request_model = CompletionRequest
    id_prefix = "cmpl-"

    async def convert(self, req: CompletionRequest) -> GenerateReqInput:
        want_logprobs = req.logprobs is not None
        return GenerateReqInput(
            **_prompt_fields(req.prompt),
            sampling_params=req.sampling_params(),
            rid=req.rid or new_rid(),
            return_logprob=want_logprobs,
            logprob_start_len=0 if (req.echo and want_logprobs) else -1,
            top_logprobs_num=req.logprobs or 0,
            stream=req.stream,
            timeout=req.timeout or 0.0,
            session_params=req.session_params,
        )

    async def echo_prompts(self, req: CompletionRequest) -> list[str]:
        """Each prompt as text, in order (token-id prompts are detokenized)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str):
            return list(prompt)  # type: ignore[arg-type]
        lists = prompt if isinstance(prompt[0], list) else [prompt]
        try:
            return [await self.tm.detokenize(list(ids)) for ids in lists]  # type: ignore[arg-type]
        except Exception as exc:  # a token id outside the vocabulary: the prompt's fault
            err = as_api_error(exc)
            if err.status_code != 400:
                raise
            raise APIError(400, err.message, err.code, "prompt") from None

    async def prepare(self, req: CompletionRequest, state: ResponseState) -> None:
        state.extra["echo"] = await self.echo_prompts(req) if req.echo else None

    def new_state(self, req: CompletionRequest, obj: GenerateReqInput) -> ResponseState:
        state = super().new_state(req, obj)
        state.extra["num_top"] = req.logprobs
        state.extra["num_text"] = {}  # index -> characters of text sent so far
        return state

    def _prompt_text(self, state: ResponseState, index: int) -> str:
        echo = state.extra["echo"]
        return echo[index // state.n] if echo is not None else ""

    def _logprobs(
        self, state: ResponseState, meta: dict[str, Any], start: int, offset: int, echo: bool
    ) -> dict[str, Any] | None:
        num_top = state.extra["num_top"]
        if num_top is None:
            return None
        tt = self.ctx.token_text
        pairs = (meta.get("output_token_logprobs") or [])[start:]
        tops = (meta.get("output_top_logprobs") or [])[start:]
        prompt_part = None
        if echo:
            in_pairs = meta.get("input_token_logprobs") or []
            in_tops = meta.get("input_top_logprobs") or []
            prompt_part = legacy_logprobs(tt, in_pairs, in_tops, num_top, 0)
            offset = sum(len(t) for t in prompt_part["tokens"])
        return merge_legacy(prompt_part, legacy_logprobs(tt, pairs, tops, num_top, offset))

    def stream_frames(self, state: ResponseState, item: dict[str, Any]) -> list[str]:
        index, meta = item["index"], item["meta_info"]
        first = index not in state.started
        state.started.add(index)
        echo = first and state.extra["echo"] is not None
        text = (self._prompt_text(state, index) if echo else "") + item["delta"]
        sent = state.extra["num_text"].get(index, 0)
        state.extra["num_text"][index] = sent + len(text)
        new = int(item.get("new_logprob_count") or 0)
        start = len(meta.get("output_token_logprobs") or []) - new
        logprobs = None
        if state.extra["num_top"] is not None and (new or echo):
            logprobs = self._logprobs(state, meta, start, sent, echo)
        frames = []
        if text or logprobs is not None:
            frames.append(self._chunk(state, index, text, logprobs, None))
        reason = finish_reason(meta)
        if reason is not None:
            frames.append(self._chunk(state, index, "", None, reason, meta["finish_reason"]))
        return frames

    def _chunk(
        self,
        state: ResponseState,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        reason: str | None,
        finish: dict[str, Any] | None = None,
    ) -> str:
        if logprobs is None and reason is None:  # the frame of nearly every token
            return state.text_frame(index, text, lambda t: self._body(state, index, t, None, None))
        return sse_data(self._body(state, index, text, logprobs, reason, finish))

    def _body(
        self,
        state: ResponseState,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        reason: str | None,
        finish: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        if finish is not None:
            choice["matched_stop"] = finish.get("matched")
        body = {**self.chunk_head(state, OBJECT), "choices": [choice]}
        if state.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, state: ResponseState, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.chunk_head(state, OBJECT), "choices": [], "usage": usage}

    def final_response(self, state: ResponseState, items: list[dict[str, Any]]) -> dict[str, Any]:
        choices = [self._choice(state, item) for item in items]
        return {**self.chunk_head(state, OBJECT), "choices": choices, "usage": state.usage()}

    def _choice(self, state: ResponseState, item: dict[str, Any]) -> dict[str, Any]:
        meta = item["meta_info"]
        reason = finish_reason(meta)
        prompt = self._prompt_text(state, item["index"])
        return {
            "index": item["index"],
            "text": prompt + item["text"],
            "logprobs": self._logprobs(state, meta, 0, 0, state.extra["echo"] is not None),
            "finish_reason": reason,
            "matched_stop": (meta.get("finish_reason") or {}).get("matched"),
        }
