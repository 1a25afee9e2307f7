"""Resolve the scheduler's "auto" settings into concrete values, once, and log them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.config import ServerArgs
from sluice.model.kv_cache import KVCache
from sluice.model.quant import resolve_quantization
from sluice.model.runner import resolve_device, resolve_dtype
from sluice.utils.system import available_cpus, available_memory_bytes

logger = logging.getLogger(__name__)

# a KV pool never needs to hold more than this many full contexts
MAX_CONTEXTS_IN_POOL = 64


@dataclass(frozen=True)
class Resources:
    device: torch.device
    dtype: torch.dtype
    num_threads: int
    context_len: int
    max_total_tokens: int
    max_running_requests: int
    quantization: str = "none"  # "gguf": a GGUF's block weights kept (sluice.model.quant)


def resolve_resources(args: ServerArgs, cfg: ModelConfig) -> Resources:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    num_threads = args.num_threads or available_cpus()
    context_len = args.context_length or cfg.max_position_embeddings
    if context_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--context-length {context_len} exceeds the model's maximum of "
            f"{cfg.max_position_embeddings} positions"
        )
    per_token = KVCache.bytes_per_token(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype
    )
    max_total = args.max_total_tokens or _auto_pool_tokens(args, device, per_token, context_len)
    max_running = args.max_running_requests or min(256, max(max_total // 64, 8))
    quantization = resolve_quantization(args.quantization, cfg.source_path, device, dtype)
    res = Resources(device, dtype, num_threads, context_len, max_total, max_running, quantization)
    logger.info(
        "KV pool: %d tokens (%.2f GiB, %d KiB per token); context %d tokens; up to %d requests "
        "running, %.1f full contexts at once; %s on %s with %d threads",
        max_total, max_total * per_token / 2**30, per_token // 1024, context_len, max_running,
        max_total / context_len, str(dtype).removeprefix("torch."), device, num_threads,
    )  # fmt: skip
    return res


def _auto_pool_tokens(args: ServerArgs, device: torch.device, per_token: int, ctx: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_memory_bytes()
    tokens = int(free * args.mem_fraction) // per_token
    return max(min(tokens, ctx * MAX_CONTEXTS_IN_POOL), 1024)
