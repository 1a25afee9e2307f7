"""Idefics3 / SmolVLM: a SigLIP-style vision tower, a pixel-shuffle connector with a linear
projection, and a Llama-family language model.

The processor splits an image into tiles of `image_size` pixels a side (plus the whole image
resized to one tile, the "global" image); each tile is its own `ImageSpan` of
`tokens_per_tile` positions. A tile's patches go through the tower, then the connector folds
each `scale_factor x scale_factor` block of neighbouring patches into one row
(`vision_hidden * scale_factor**2` wide) and projects it to the language model's width. The
rows replace the input embeddings of the tile's placeholder positions, as in LLaVA.

Tiles are always full `image_size` squares (the processor resizes images to whole tiles), so
the tower's patch mask is all ones and its position ids are one fixed table, computed below the
way transformers computes them for a full tile.

Parameter names: the checkpoint's `model.vision_model.*`, `model.connector.*`,
`model.text_model.*` and `lm_head.*` are this module's `vision_model.*`, `connector.*`,
`language_model.model.*` and `language_model.lm_head.*` (`module_name`). SmolVLM's checkpoints
have the same layout and modules as Idefics3's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.models.clip import CLIPEncoder, CLIPVisionConfig, embed_patches
from sluice.model.models.llama import LlamaForCausalLM
from sluice.model.models.vision_language import VisionLanguageModel


@dataclass(frozen=True)
class Idefics3VisionConfig(CLIPVisionConfig):
    """A checkpoint's `vision_config`; the defaults are transformers' (which config.json may
    leave out). Its encoder layers are CLIP's (pre-norm attention and MLP, the same names)."""

    # any: transformers builds these architectures' tower whatever vision_config.model_type says
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    hidden_size: int = 1152
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class Idefics3MultimodalConfig:
    """The vision side of an Idefics3 / SmolVLM config.json (all of it but `text_config`)."""

    vision: Idefics3VisionConfig
    image_token_id: int
    scale_factor: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Idefics3MultimodalConfig:
        mm = cls(
            vision=Idefics3VisionConfig.from_dict(d.get("vision_config") or {}),
            image_token_id=int(d.get("image_token_id", 128257)),
            scale_factor=int(d.get("scale_factor", 2)),
        )
        if mm.vision.patches_per_side % mm.scale_factor:
            raise ValueError(
                f"{mm.vision.patches_per_side} patches a side do not fold by scale_factor "
                f"{mm.scale_factor}"
            )
        return mm

    @property
    def tokens_per_tile(self) -> int:
        """Placeholder positions one tile takes (the processor's `image_seq_len`)."""
        return (self.vision.patches_per_side // self.scale_factor) ** 2


def tile_position_ids(patches_per_side: int) -> torch.Tensor:
    """Position ids [patches] of a full tile's patches, row-major, computed as transformers'
    variable-resolution embeddings do for a tile without padding (fractional coordinates
    bucketed by float32 boundaries), so a rounding there is a rounding here too."""
    n = patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    step = 1.0 / torch.tensor([n])  # float32, as the mask's patch count divides
    coords = torch.clamp(torch.arange(n, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)  # [n]
    return (buckets[:, None] * n + buckets[None, :]).flatten()


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, vc: Idefics3VisionConfig) -> None:
        super().__init__()
        self.image_size = vc.image_size
        self.patch_embedding = nn.Conv2d(
            vc.num_channels, vc.hidden_size, vc.patch_size, stride=vc.patch_size
        )
        self.patches_per_side = vc.patches_per_side
        self.position_embedding = nn.Embedding(vc.patches_per_side**2, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [I, C, H, W] (tiles) -> [I, patches, hidden]
        patches = embed_patches(self.patch_embedding, pixel_values, self.image_size)
        position_ids = tile_position_ids(self.patches_per_side).to(patches.device)
        return patches + self.position_embedding(position_ids)


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, vc: Idefics3VisionConfig) -> None:
        super().__init__()
        self.embeddings = Idefics3VisionEmbeddings(vc)
        self.encoder = CLIPEncoder(vc, vc.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [I, C, H, W] -> [I, patches, hidden]; every patch sees its whole tile
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[I, side * side, D] -> [I, side * side / scale**2, D * scale**2]: the patches' grid
    folded by `scale` along each side (transformers' order of the folded features)."""
    num_images, seq_len, width = x.shape
    side = int(seq_len**0.5)
    x = x.view(num_images, side, side // scale, width * scale)  # columns folded
    x = x.permute(0, 2, 1, 3)  # [I, side / scale, side, D * scale]
    x = x.reshape(num_images, side // scale, side // scale, width * scale * scale)  # rows
    x = x.permute(0, 2, 1, 3)  # back to row-major
    return x.reshape(num_images, seq_len // (scale * scale), width * scale * scale)


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, mm: Idefics3MultimodalConfig, text_hidden: int) -> None:
        super().__init__()
        in_features = mm.vision.hidden_size * mm.scale_factor**2
        self.proj = nn.Linear(in_features, text_hidden, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, mm: Idefics3MultimodalConfig, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = mm.scale_factor
        self.modality_projection = Idefics3SimpleMLP(mm, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [I, patches, vision_hidden] -> [I, tokens_per_tile, text_hidden]
        x = pixel_shuffle(x, self.scale_factor)
        num_tiles, num_tokens, width = x.shape
        out = self.modality_projection.proj(x.reshape(-1, width))
        return out.view(num_tiles, num_tokens, -1)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    family = "Idefics3"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.multimodal is None:
            raise ValueError(f"{cfg.hf_dir}: config.json has no vision part (text_config)")
        self.cfg = cfg
        self.mm_cfg = Idefics3MultimodalConfig.from_dict(cfg.multimodal)
        self.vision_model = Idefics3VisionTransformer(self.mm_cfg.vision)
        self.connector = Idefics3Connector(self.mm_cfg, cfg.hidden_size)
        self.language_model = LlamaForCausalLM(cfg)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [I, C, H, W] (tiles) -> [I, tokens_per_tile, text_hidden]
        return self.connector(self.vision_model(pixel_values))

    def module_name(self, checkpoint_name: str) -> str:
        return module_name(checkpoint_name)


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's modules and checkpoint names (its processor differs for video only,
    which sluice does not take)."""


def module_name(checkpoint_name: str) -> str:
    """The name in `Idefics3ForConditionalGeneration` of a tensor of the checkpoint."""
    name = checkpoint_name
    if name.startswith("lm_head."):
        return "language_model." + name
    name = name.removeprefix("model.")
    if name.startswith("text_model."):
        return "language_model.model." + name.removeprefix("text_model.")
    return name
