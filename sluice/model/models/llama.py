"""Llama-family decoder: Llama, Mistral, Qwen2 (attention biases), SmolLM2.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up projections
are fused into `qkv_proj` and `gate_up_proj` (one matmul each instead of three and two); the
loader maps the checkpoint's separate tensors into their slices (`STACKED`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.forward_batch import ForwardBatch, ForwardOutput
from sluice.model.kv_cache import KVCache
from sluice.model.layers import PagedAttention, RMSNorm, RotaryEmbedding

# checkpoint name fragment -> (fused name fragment, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)  # of qkv_proj, for loading
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.shard_sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rope = rope
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self, x: torch.Tensor, fb: ForwardBatch, kv: KVCache, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], or [len(rows), hidden]: only those rows' outputs
        (every row's K/V is still written)."""
        q, k, v = self.rope(fb.positions, self.qkv_proj(x), self.num_heads, self.num_kv_heads)
        out = self.attn(q, k, v, fb, kv)
        return self.o_proj(out if rows is None else out[rows])


class LlamaMLP(nn.Module):
    cpu_ops: Any | None = None  # sluice.model.kernels.cpu_ops() on CPU (set by the runner)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.shard_sizes = (cfg.intermediate_size, cfg.intermediate_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            # the activation from gate_up's own GEMM where its layer has that (on AMX tiles)
            silu_mul = getattr(self.gate_up_proj, "silu_mul", None)
            h = None if silu_mul is None else silu_mul(x)
            if h is None:
                h = self.cpu_ops.silu_and_mul(self.gate_up_proj(x))
            return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rope)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
        kv: KVCache,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer's norm adds
        the two, in one pass with its normalization. `rows`: only those rows past attention."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if rows is not None:
            residual = residual[rows]
        h, residual = self.post_attention_layernorm(self.self_attn(h, fb, kv, rows), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    # decode steps of a few rows in one C++ call (sluice.model.fused_decode; set by the runner
    # where it can take them): the same hidden states as the layers below, less glue
    fused_decode: Any | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # no random init (about a second for 49152 x 576): the checkpoint's weights replace it
        unset = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=unset)
        rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, rope) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        fb: ForwardBatch,
        kv: KVCache,
        input_embeds: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-norm hidden states [T, hidden], or [len(rows), hidden]: those rows' only.
        The last layer then runs its o_proj and MLP on those rows alone (a prompt's other rows
        only need their K/V, which every layer writes): SmolLM2-135M's prefill does about 1/36
        fewer GEMM FLOPs. No rows (a prompt's chunk before its last): the K/V and no hidden
        states. `input_embeds` [T, hidden]: the inputs in place of `embed_tokens(fb.input_ids)`
        (a vision-language model's, with its image features in the placeholder rows)."""
        fused = self.fused_decode
        if fused is not None and input_embeds is None and fused.supports(fb, kv):
            return fused.forward(fb, rows)
        x = self.embed_tokens(fb.input_ids) if input_embeds is None else input_embeds
        residual = None  # x: [T, hidden]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, fb, kv, rows if i == last else None)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Returns logits [N, vocab] for the rows in `fb.logits_index` only."""
        return self.forward_output(fb, kv).logits

    def forward_output(
        self, fb: ForwardBatch, kv: KVCache, input_embeds: torch.Tensor | None = None
    ) -> ForwardOutput:
        """Logits and final-norm hidden states (last-token pooling) of the `fb.logits_index`
        rows, from one forward; the hidden rows cost nothing extra."""
        rows = None if fb.all_logits else fb.logits_index
        hidden = self.model(fb, kv, input_embeds, rows)  # [N, hidden]
        return ForwardOutput(self.lm_head(hidden), hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            target, shard = _stacked_target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            if shard is None:
                _copy(param, tensor, name)
            else:
                module = self.get_submodule(target.rsplit(".", 2)[0])
                sizes = module.shard_sizes
                start = sum(sizes[:shard])
                _copy(param.narrow(0, start, sizes[shard]), tensor, name)
            loaded.add(f"{target}#{shard}")
        self._check_all_loaded(params, loaded)

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj"):
                n = 3 if "qkv" in name else 2
                if any(f"{name}#{i}" not in loaded for i in range(n)):
                    missing.append(name)
            elif f"{name}#None" not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _stacked_target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return name, None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dst.dtype))


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass
