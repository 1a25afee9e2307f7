"""POST /v1/embeddings, and the routing of requests to the encoder models of a server.

`input` is a string, a list of strings, a list of token ids or a list of lists of them.
`encoding_format` "float" (default) or "base64" (little-endian float32, what the openai SDK asks
for); `dimensions` truncates each vector and re-normalizes it; `truncate_prompt_tokens` keeps
the first N tokens of longer inputs (without it, a longer input than the model takes is a 400).
`data[i].index` follows input order.

`model` is an embedding model, or the chat model itself: a decoder's embedding is the final-norm
hidden state of an input's last token, L2-normalized. Without `model`: the embedding model when
the server has one, else the decoder.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from sluice.server.errors import APIError, error_response
from sluice.server.protocol import Positive
from sluice.server.serving_base import ServingContext, parse_body, run_until_disconnect

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: Positive | None = None
    truncate_prompt_tokens: Positive | None = None
    user: str | None = None


def served_model_names(ctx: ServingContext, models: list[Any]) -> list[str]:
    names = [ctx.model_name, *(m.model_name for m in models)]
    return list(dict.fromkeys(names))


def pick_model(
    ctx: ServingContext, models: list[Any], model: str | None, task: str, prefer: tuple[str, ...]
) -> Any:
    """The pooled model (an EmbeddingManager) that serves `task` for a request: the one it
    names, or, when it names none, the first model whose own task is in `prefer` (in that order:
    "rerank" a cross-encoder, "embed" an embedding model, "generate" the decoder).

    A served model that cannot serve `task` is a 400; a model not served at all is a 404
    naming those that are."""
    if not model:
        for kind in prefer:
            found = next((m for m in models if m.task == kind), None)
            if found is not None:
                return found
        need = " (scoring needs a decoder model)" if task == "score" else ""
        raise APIError(
            400, f"this server serves no model for {task}{need}", "model_not_found", "model"
        )
    found = next((m for m in models if m.model_name == model), None)
    if found is not None and task in found.tasks:
        return found
    names = served_model_names(ctx, models)
    if found is not None or model in names:
        raise APIError(
            400, f"the model '{model}' cannot serve this route ({task})",
            "invalid_request_error", "model",
        )  # fmt: skip
    served = ", ".join(f"'{n}'" for n in names)
    raise APIError(
        404,
        f"The model '{model}' does not exist; this server serves {served}.",
        "model_not_found",
        "model",
    )


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def truncate_dimensions(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` components, re-normalized to unit length (Matryoshka)."""
    if dimensions is None or dimensions == len(vector):
        return vector
    head = vector[:dimensions].astype(np.float32)
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head


class ServingEmbedding:
    """`models`: the pooled models (encoders, then the decoder's manager if any)."""

    def __init__(self, ctx: ServingContext, models: list[Any]) -> None:
        self.ctx, self.models = ctx, models

    async def handle(self, raw_request: Request) -> Response:
        try:
            req = await parse_body(raw_request, EmbeddingRequest)
            encoder = pick_model(self.ctx, self.models, req.model, "embed", ("embed", "generate"))
            self._check(req, encoder)
            return await run_until_disconnect(raw_request, self._respond(req, encoder))
        except Exception as exc:
            return error_response(exc)

    def _check(self, req: EmbeddingRequest, encoder: Any) -> None:
        if req.encoding_format not in ENCODING_FORMATS:
            raise APIError(
                400, f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}",
                "invalid_request_error", "encoding_format",
            )  # fmt: skip
        if req.dimensions is not None and req.dimensions > encoder.dimensions:
            raise APIError(
                400, f"dimensions {req.dimensions} is larger than the model's {encoder.dimensions}",
                "invalid_request_error", "dimensions",
            )  # fmt: skip

    async def _respond(self, req: EmbeddingRequest, encoder: Any) -> Response:
        inputs = _inputs(req.input)
        vectors, num_tokens = await encoder.embed(inputs, req.truncate_prompt_tokens)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_vector(
                    truncate_dimensions(v, req.dimensions), req.encoding_format
                ),
            }
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return JSONResponse(
            {"object": "list", "data": data, "model": encoder.model_name, "usage": usage}
        )


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """A list of inputs, each a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input must not be empty", "invalid_request_error", "input")
    if all(isinstance(v, int) for v in value):
        return [list(value)]
    return list(value)
