"""ModelRunner: owns the model weights and the KV tensors; runs one ForwardBatch at a time.

Runs inside the scheduler process. It knows nothing of requests: the scheduler hands it a
ForwardBatch and gets logits back (and, when asked, the hidden states of the same rows).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.attention import select_backends
from sluice.model.forward_batch import ForwardBatch, ForwardOutput
from sluice.model.fused_decode import install_fused_decode
from sluice.model.kv_cache import KVCache
from sluice.model.layers import PackedLinear, PagedAttention, can_pack_linears, pack_linears
from sluice.model.loader import iter_hf_weights
from sluice.model.models.idefics3 import (
    Idefics3ForConditionalGeneration,
    SmolVLMForConditionalGeneration,
)
from sluice.model.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from sluice.model.models.llava import LlavaForConditionalGeneration
from sluice.model.multimodal import ImageFeatureCache
from sluice.utils.system import cpu_flags, native_bf16_flag

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "SmolVLMForConditionalGeneration": SmolVLMForConditionalGeneration,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA and on CPUs that compute it natively (AMX-BF16 or AVX512-BF16),
    float32 on other CPUs; the choice and its reason are logged."""
    if dtype == "auto":
        chosen, reason = auto_dtype(device, cpu_flags())
        logger.info("--dtype auto: %s (%s)", str(chosen).removeprefix("torch."), reason)
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def auto_dtype(device: torch.device, flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """What `--dtype auto` means on `device` with CPU `flags`, and why."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flag = native_bf16_flag(flags)
    if flag is not None:
        return torch.bfloat16, f"this CPU computes bfloat16 natively: {flag}"
    return torch.float32, "this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16 flag)"


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        kv_size: int,
        quantization: str = "none",
        image_cache_bytes: int = 0,
    ) -> None:
        """`quantization`: "gguf" keeps a GGUF's block weights, "int8"/"int4" quantize the float
        weights into blocks at load (sluice.model.quant), "none" neither.
        `image_cache_bytes`: room for image features kept by image hash (vision models)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.model = load_model(cfg, device, dtype, quantization)
        self.image_cache = ImageFeatureCache(image_cache_bytes)
        self.kv = KVCache(
            kv_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, device
        )
        self.fused_decode = install_fused_decode(self.model, self.kv)  # None: per-op path only
        # the sampler's grammar masks (sluice.model.sampler) on float32 logits, whatever the
        # dtype; and the per-op path's K/V writes (a copy of rows, in any dtype)
        self.cpu_ops = _cpu_kernels(device)
        self.kv.cpu_ops = self.cpu_ops

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, float_logits: bool = True) -> torch.Tensor:
        """Logits [N, vocab] for the rows in `fb.logits_index`: in float32, or with
        `float_logits` False in the model's dtype (a step that only takes each row's argmax,
        which widening does not change, skips the copy)."""
        self._encode_images(fb)
        logits = self.model(fb, self.kv)
        return logits.float() if float_logits else logits

    @torch.inference_mode()
    def forward_output(self, fb: ForwardBatch) -> ForwardOutput:
        """Logits and final-norm hidden states, both float32, of the `fb.logits_index` rows
        (for batches with embedding requests, which pool the last token's hidden state)."""
        self._encode_images(fb)
        out = self.model.forward_output(fb, self.kv)
        return ForwardOutput(out.logits.float(), out.hidden.float())

    def _encode_images(self, fb: ForwardBatch) -> None:
        """The features of the batch's images, from the cache or the model's vision side."""
        mm = fb.mm_inputs
        if mm is not None and mm.features is None:
            mm.features = self.image_cache.features(
                mm.images, self.model.image_features, self.device
            )


def load_model(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: str = "none"
) -> nn.Module:
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {cfg.architecture} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    start = time.perf_counter()
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture](cfg)
    # materialize without running random initialisation, then fill from the checkpoint
    model = model.to_empty(device=device).to(dtype)
    text_model = getattr(model, "language_model", model)  # a vision-language model's, or itself
    if cfg.tie_word_embeddings:
        text_model.lm_head.weight = text_model.model.embed_tokens.weight
    _init_buffers(text_model, cfg, device)
    weights = iter_hf_weights(cfg.hf_dir)
    if quantization == "gguf":  # the linears that stay in blocks skip their float tensors
        from sluice.model.gguf_weights import install_quantized
        from sluice.model.kernels import quant_ops

        skip = install_quantized(model, cfg, quant_ops()).checkpoint_names
        weights = ((name, t) for name, t in weights if name not in skip)
    model.load_weights(weights)
    if quantization in ("int8", "int4"):
        from sluice.model.kernels import quant_ops
        from sluice.model.quant import LOAD_TYPES, quantize_linears

        quantize_linears(model, LOAD_TYPES[quantization], quant_ops())
    in_blocks = 0  # weights kept in GGUF blocks (buffers, not parameters)
    if quantization != "none":  # batches of many rows: a float copy beats the kernel
        from sluice.model.quant import QuantLinear, keep_dense_copies

        keep_dense_copies(model, dtype)
        blocks = [m for m in model.modules() if isinstance(m, QuantLinear)]
        if cfg.tie_word_embeddings:  # a tied lm_head's blocks are the embedding's, counted
            blocks = [m for m in blocks if m is not text_model.lm_head]
        in_blocks = sum(m.in_features * m.out_features for m in blocks)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters()) + in_blocks
    if can_pack_linears(device, dtype):
        pack_linears(model)
    _use_kernels(model, device, dtype, cfg.head_dim)
    blocks_note = f", {in_blocks / 1e6:.0f}M of them in blocks" if in_blocks else ""
    logger.info(
        "loaded %s (%s, %.0fM parameters%s, %s on %s) in %.1f s",
        cfg.model_name, cfg.architecture, num_params / 1e6, blocks_note,
        str(dtype).removeprefix("torch."), device, time.perf_counter() - start,
    )  # fmt: skip
    return model


def _cpu_kernels(device: torch.device) -> Any | None:
    """The C++ kernels on the CPU, in any dtype (the sampler's masks and the K/V writes take
    them whatever the model's dtype); None elsewhere or where they cannot be built."""
    if device.type != "cpu":
        return None
    from sluice.model.kernels import cpu_ops

    return cpu_ops()


def _use_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Choose the attention backends once for every layer (sluice.model.attention), and hand
    sluice's C++ CPU kernels, on CPU in the dtypes they take, to every other module that has a
    `cpu_ops` slot (None when they cannot be built: those modules keep PyTorch ops)."""
    ops = None
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from sluice.model.kernels import cpu_ops

        ops = cpu_ops()
    backends = select_backends(device, head_dim, ops)
    logger.info("attention backends: %s", ", ".join(b.name for b in backends))
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.backends = backends
        elif hasattr(type(module), "cpu_ops"):
            module.cpu_ops = ops
    fused = 0  # gate_up projections that give their SiLU from their GEMM (PackedLinear)
    for module in model.modules():
        fuse = getattr(getattr(module, "gate_up_proj", None), "fuse_silu_mul", None)
        fused += ops is not None and fuse is not None and fuse()
    amx = sum(isinstance(m, PackedLinear) and m.amx is not None for m in model.modules())
    if amx:
        logger.info(
            "%d linear layers take bfloat16 batches of %d rows or more on sluice's AMX GEMM (%d "
            "gate_up projections with their SiLU in it)", amx, PackedLinear.AMX_MIN_ROWS, fused,
        )  # fmt: skip


def _init_buffers(model: LlamaForCausalLM, cfg: ModelConfig, device: torch.device) -> None:
    """Non-persistent buffers (the rope table) are not in checkpoints: compute them for real."""
    from sluice.model.layers import RotaryEmbedding

    rope = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    for layer in model.model.layers:
        layer.self_attn.rope = rope
