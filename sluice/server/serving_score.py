"""POST /v1/score: a decoder's next-token probabilities of label tokens (SGLang's scoring API).

`{model?, query: str | [ids], items: str | [str] | [[ids]], label_token_ids: [ids],
apply_softmax=false, item_first=false}` → `{scores: [[p per label] per item], model, usage,
object: "scoring"}`. Each item's prompt is query + item (item + query with `item_first`): text
concatenated, or token ids concatenated. `apply_softmax` false: each label's probability in the
full next-token distribution; true: a softmax over the labels' log-probabilities only (they sum
to 1). Only a decoder scores; an encoder model is a 400.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from sluice.server.errors import APIError, error_response
from sluice.server.protocol import TokenId
from sluice.server.serving_base import ServingContext, parse_body, run_until_disconnect
from sluice.server.serving_embedding import pick_model


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str | list[int]
    items: str | list[str] | list[list[int]]
    label_token_ids: list[TokenId] | None = None
    apply_softmax: bool = False
    item_first: bool = False


def label_probabilities(logprobs: np.ndarray, apply_softmax: bool) -> list[float]:
    """Probabilities from the labels' next-token log-probabilities `[num_labels]`."""
    lp = logprobs.astype(np.float64)
    if apply_softmax:
        e = np.exp(lp - lp.max())
        return [float(x) for x in e / e.sum()]
    return [float(x) for x in np.exp(lp)]


def score_prompts(
    query: str | list[int], items: str | list[str] | list[list[int]], item_first: bool
) -> list[str] | list[list[int]]:
    """One prompt per item: texts with a text query, token ids with a token-id query."""
    listed = [items] if isinstance(items, str) else list(items)
    if not listed:
        raise _bad("items must not be empty", "items")
    if isinstance(query, str):
        if not all(isinstance(i, str) for i in listed):
            raise _bad("items must be strings when the query is a string", "items")
        return [i + query if item_first else query + i for i in listed]  # type: ignore[operator]
    if not all(isinstance(i, list) for i in listed):
        raise _bad("items must be lists of token ids when the query is token ids", "items")
    return [
        [*i, *query] if item_first else [*query, *i]  # type: ignore[misc]
        for i in listed
    ]


class ServingScore:
    """`models`: the pooled models (encoders, then the decoder's manager if any)."""

    def __init__(self, ctx: ServingContext, models: list[Any]) -> None:
        self.ctx, self.models = ctx, models

    async def handle(self, raw_request: Request) -> Response:
        try:
            req = await parse_body(raw_request, ScoreRequest)
            decoder = pick_model(self.ctx, self.models, req.model, "score", ("generate",))
            if not req.label_token_ids:
                raise _bad(
                    "label_token_ids must be a non-empty list of token ids", "label_token_ids"
                )
            prompts = score_prompts(req.query, req.items, req.item_first)
            return await run_until_disconnect(raw_request, self._respond(req, decoder, prompts))
        except Exception as exc:
            return error_response(exc)

    async def _respond(
        self, req: ScoreRequest, decoder: Any, prompts: list[str] | list[list[int]]
    ) -> Response:
        labels = list(req.label_token_ids or [])
        vectors, num_tokens = await decoder.score_labels(prompts, labels, "items")
        body = {
            "scores": [label_probabilities(v, req.apply_softmax) for v in vectors],
            "model": decoder.model_name,
            "usage": {"prompt_tokens": num_tokens, "completion_tokens": 0,
                      "total_tokens": num_tokens},
            "object": "scoring",
        }  # fmt: skip
        return JSONResponse(body)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param)
