"""CLIP vision tower, as vision-language models use it: the hidden states of chosen layers.

Parameter names follow transformers' `CLIPVisionModel` without its `vision_model.` prefix (the
layout transformers 5 saves; older checkpoints keep the prefix, and the loader of the model that
holds the tower strips it). `post_layernorm` only feeds CLIP's pooled output, which no
vision-language model reads, so it is not built; nor are the layers after the last one read.

Every linear sees 2-D rows ([images * seq, features]), the shape sluice's packed CPU linears take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# config.json `hidden_act` -> function; the names transformers' ACT2FN gives them
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class CLIPVisionConfig:
    """A checkpoint's `vision_config`; the defaults are those of LLaVA-1.5's CLIP ViT-L/14-336,
    which its config.json leaves out."""

    # vision_config.model_type values taken (the first: the default); empty: any
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("clip_vision_model",)
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        model_type = d.get("model_type", cls.MODEL_TYPES[0] if cls.MODEL_TYPES else None)
        if cls.MODEL_TYPES and model_type not in cls.MODEL_TYPES:
            raise ValueError(
                f"unsupported vision tower {model_type!r}; supported: {', '.join(cls.MODEL_TYPES)}"
            )
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _rows(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear` on the last dim of x [..., in] through 2-D rows: [..., out]."""
    return linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, vc: CLIPVisionConfig) -> None:
        super().__init__()
        self.image_size = vc.image_size
        self.class_embedding = nn.Parameter(torch.empty(vc.hidden_size))
        self.patch_embedding = nn.Conv2d(
            vc.num_channels, vc.hidden_size, vc.patch_size, stride=vc.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(vc.num_patches + 1, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [I, C, H, W] -> [I, 1 + patches, hidden] (the class token first)
        patches = embed_patches(self.patch_embedding, pixel_values, self.image_size)
        cls = self.class_embedding.expand(pixel_values.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


def embed_patches(conv: nn.Conv2d, pixel_values: torch.Tensor, image_size: int) -> torch.Tensor:
    """The patch embeddings [I, patches, hidden] of square images [I, C, image_size,
    image_size] (a ValueError for another size), row-major over the patch grid."""
    _, _, height, width = pixel_values.shape
    if height != image_size or width != image_size:
        raise ValueError(
            f"image of {height}x{width} pixels; the vision tower takes {image_size}x{image_size}"
        )
    patches = conv(pixel_values.to(conv.weight.dtype))  # [I, hidden, gh, gw]
    return patches.flatten(2).transpose(1, 2)


class CLIPAttention(nn.Module):
    def __init__(self, vc: CLIPVisionConfig) -> None:
        super().__init__()
        self.num_heads = vc.num_attention_heads
        self.head_dim = vc.hidden_size // vc.num_attention_heads
        self.q_proj = nn.Linear(vc.hidden_size, vc.hidden_size)
        self.k_proj = nn.Linear(vc.hidden_size, vc.hidden_size)
        self.v_proj = nn.Linear(vc.hidden_size, vc.hidden_size)
        self.out_proj = nn.Linear(vc.hidden_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [I, S, hidden]; every position sees every position of its own image
        num_images, seq_len, hidden = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:  # [I, heads, S, head_dim]
            out = _rows(proj, x).view(num_images, seq_len, self.num_heads, self.head_dim)
            return out.transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        )
        return _rows(self.out_proj, out.transpose(1, 2).reshape(num_images, seq_len, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, vc: CLIPVisionConfig) -> None:
        super().__init__()
        self.act = activation(vc.hidden_act)
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [I, S, hidden]
        return _rows(self.fc2, self.act(_rows(self.fc1, x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc: CLIPVisionConfig) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(vc)
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = CLIPMLP(vc)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [I, S, hidden], pre-norm residual blocks
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, vc: CLIPVisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Hidden states of the layers in `feature_layers`, as transformers numbers them: 0 is the
    embeddings after `pre_layrnorm`, k the output of encoder layer k, negative from the end
    (-1: the last layer, before `post_layernorm`)."""

    def __init__(self, vc: CLIPVisionConfig, feature_layers: list[int]) -> None:
        super().__init__()
        total = vc.num_hidden_layers
        self.feature_layers = [k if k >= 0 else total + 1 + k for k in feature_layers]
        if not all(0 <= k <= total for k in self.feature_layers):
            raise ValueError(f"vision feature layers {feature_layers} outside 0..{total}")
        self.embeddings = CLIPVisionEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.encoder = CLIPEncoder(vc, num_layers=max(self.feature_layers))

    @property
    def num_layers(self) -> int:
        """Encoder layers built and run: up to the deepest one read."""
        return len(self.encoder.layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        # pixel_values: [I, C, H, W] -> one [I, 1 + patches, hidden] per feature layer
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        kept = {0: x}
        for k, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if k in self.feature_layers:
                kept[k] = x
        return [kept[k] for k in self.feature_layers]
