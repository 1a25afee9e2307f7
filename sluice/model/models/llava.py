"""LLaVA: a CLIP vision tower, an MLP projector, and a Llama-family language model.

An image's features (the tower's hidden states of `vision_feature_layer`, without the class
token under the "default" strategy, projected to the language model's width) replace the
input embeddings of its placeholder positions; everything after the embeddings is the text
model's forward, unchanged. Which rows of this forward take which features is the batch's
`mm_inputs` (sluice.model.multimodal); a forward without images is the text model's own.

Parameter names are those transformers saves (`vision_tower.*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*`); `load_weights` also takes the layout of
transformers 4.52+ (`model.vision_tower.*`, `model.language_model.*`, `lm_head.*`) and CLIP's
`vision_model.` prefix of older checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.models.clip import CLIPVisionConfig, CLIPVisionTower, activation
from sluice.model.models.llama import LlamaForCausalLM
from sluice.model.models.vision_language import VisionLanguageModel


@dataclass(frozen=True)
class LlavaVisionConfig:
    """The vision side of a LLaVA config.json (all of it but `text_config`)."""

    vision: CLIPVisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]  # hidden states read, concatenated in this order
    select_strategy: str  # "default": drop the class token; "full": keep it
    projector_act: str
    projector_bias: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlavaVisionConfig:
        layer = d.get("vision_feature_layer", -2)
        strategy = d.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
        return cls(
            vision=CLIPVisionConfig.from_dict(d.get("vision_config") or {}),
            image_token_id=int(d.get("image_token_index", d.get("image_token_id", 32000))),
            feature_layers=(layer,) if isinstance(layer, int) else tuple(layer),
            select_strategy=strategy,
            projector_act=d.get("projector_hidden_act", "gelu"),
            projector_bias=bool(d.get("multimodal_projector_bias", True)),
        )

    @property
    def tokens_per_image(self) -> int:
        """Placeholder positions one image takes."""
        return self.vision.num_patches + (self.select_strategy == "full")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, mm: LlavaVisionConfig, text_hidden: int) -> None:
        super().__init__()
        in_features = mm.vision.hidden_size * len(mm.feature_layers)
        self.linear_1 = nn.Linear(in_features, text_hidden, bias=mm.projector_bias)
        self.act = activation(mm.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=mm.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, vision_hidden * feature layers] -> [rows, text_hidden]
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    family = "LLaVA"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.multimodal is None:
            raise ValueError(f"{cfg.hf_dir}: config.json has no vision part (text_config)")
        self.cfg = cfg
        self.mm_cfg = LlavaVisionConfig.from_dict(cfg.multimodal)
        self.vision_tower = CLIPVisionTower(self.mm_cfg.vision, list(self.mm_cfg.feature_layers))
        self.multi_modal_projector = LlavaMultiModalProjector(self.mm_cfg, cfg.hidden_size)
        self.language_model = LlamaForCausalLM(cfg)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [I, C, H, W] -> [I, tokens_per_image, text_hidden]
        states = self.vision_tower(pixel_values)  # each [I, 1 + patches, vision_hidden]
        if self.mm_cfg.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        x = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        num_images, num_tokens, width = x.shape
        return self.multi_modal_projector(x.reshape(-1, width)).view(num_images, num_tokens, -1)

    def module_name(self, checkpoint_name: str) -> str:
        return module_name(checkpoint_name)

    def is_unused(self, name: str) -> bool:
        """Also CLIP's pooled-output norm and the tower's layers after the deepest feature
        layer, which nothing reads."""
        if name.startswith("vision_tower.post_layernorm.") or super().is_unused(name):
            return True
        prefix = "vision_tower.encoder.layers."
        if name.startswith(prefix):
            return int(name.removeprefix(prefix).split(".", 1)[0]) >= self.vision_tower.num_layers
        return False


def module_name(checkpoint_name: str) -> str:
    """The name in `LlavaForConditionalGeneration` of a tensor saved in any of transformers'
    LLaVA layouts."""
    name = checkpoint_name
    # transformers 4.52+: model.{vision_tower,multi_modal_projector,language_model}, lm_head
    if name.startswith("model."):
        name = name.removeprefix("model.")
        if name.startswith("language_model."):
            name = "language_model.model." + name.removeprefix("language_model.")
    elif name.startswith("lm_head."):
        name = "language_model." + name
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
    return name
