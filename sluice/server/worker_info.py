"""What a router in front of sluice reads from it to register it as a worker.

SGLang's model gateway (`sglang-router` 0.3.2) registers a worker by asking `GET /server_info`
(on a 404, `GET /get_server_info`) for `model_path` and `served_model_name`, and
`GET /model_info` (on a 404, `GET /get_model_info`) for `model_type` and `architectures`. It
names the worker's model `served_model_name`, else `model_path`, else "unknown"; requests go
to the workers of the `model` they name, and the gateway loads its own tokenizer (for its
/v1/tokenize) from `model_path`. So both info routes carry resolved values, never an unset
setting: `served_model_name` is the name the OpenAI routes answer to.

Before that, the gateway probes each worker for gRPC (an HTTP/2 preface), which uvicorn refuses
with a 400 and a warning; `quiet_protocol_probes` logs that at INFO, saying what it was.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sluice.tokenizer.main_model import MainModel

UVICORN_LOGGER = "uvicorn.error"
_INVALID_REQUEST = "Invalid HTTP request received."  # uvicorn's warning, h11 and httptools alike
_EXPLAINED = (
    "answered 400 to a request that is not HTTP/1.x (such as the gRPC probe SGLang's gateway "
    "sends before it registers a worker over HTTP)"
)


def identity(tm: MainModel, server_args: Any, model_name: str) -> dict[str, Any]:
    """The keys that name the model: the path it was loaded from (the default model's when
    --model-path was not given), its Hugging Face directory (tokenizer included) and the name
    the API serves it under. (`model_config` is None only in tests.)"""
    cfg = tm.model_config
    return {
        "model_path": getattr(cfg, "source_path", None) or getattr(server_args, "model_path", None),
        "tokenizer_path": getattr(cfg, "hf_dir", None),
        "served_model_name": model_name,
    }


def model_info(tm: MainModel, server_args: Any, model_name: str) -> dict[str, Any]:
    """/model_info: SGLang's fields (`model_path`, `tokenizer_path`, `is_generation`,
    `model_type`, `architectures`) and sluice's own (`architecture`, `context_length`, ...)."""
    cfg = tm.model_config
    architecture = getattr(cfg, "architecture", None)
    return {
        **identity(tm, server_args, model_name),
        "architecture": architecture,
        "architectures": [architecture] if architecture else [],
        "model_type": _hf_model_type(getattr(cfg, "hf_dir", None)),
        "context_length": int(tm.context_len),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "is_generation": tm.can_generate,
    }


def _hf_model_type(hf_dir: str | None) -> str | None:
    """config.json's `model_type` ("llama", "qwen2", "bert"), or None where there is none."""
    if not hf_dir:
        return None
    try:
        value = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class _ProtocolProbeFilter(logging.Filter):
    """Rewrites uvicorn's "Invalid HTTP request received." warning as an INFO that says what
    such a request usually is; passes every other record unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.getMessage() != _INVALID_REQUEST:
            return True
        record.msg, record.args = _EXPLAINED, ()
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return logging.getLogger(UVICORN_LOGGER).isEnabledFor(logging.INFO)


def quiet_protocol_probes() -> None:
    """Installs the filter on uvicorn's logger, once per process (uvicorn's logging config
    replaces that logger's handlers, never its filters)."""
    target = logging.getLogger(UVICORN_LOGGER)
    if not any(isinstance(f, _ProtocolProbeFilter) for f in target.filters):
        target.addFilter(_ProtocolProbeFilter())
