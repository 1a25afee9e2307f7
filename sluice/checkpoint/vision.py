"""ImageSlots: how a vision-language checkpoint's images sit in its token sequence, from
config.json alone (no torch), for the HTTP process (placeholder expansion) and the scheduler
(checking what arrives).

LLaVA: one image is `(image_size // patch_size) ** 2` positions (one per CLIP patch), one more
under the "full" feature strategy (the class token kept); its pixels are [num_channels,
image_size, image_size]. The defaults are those of LLaVA-1.5's CLIP ViT-L/14-336, which its
config.json leaves out (as `sluice.model.models.clip.CLIPVisionConfig`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.checkpoint.model_config import ModelConfig


@dataclass(frozen=True)
class ImageSlots:
    image_token_id: int  # the placeholder the prompt holds, one per image before expansion
    tokens_per_image: int  # positions one image takes once expanded
    pixel_shape: tuple[int, int, int]  # [C, H, W] of the processor's pixel_values

    @classmethod
    def of(cls, cfg: ModelConfig) -> ImageSlots | None:
        """None for a text-only model."""
        mm = cfg.multimodal
        if mm is None:
            return None
        vision = mm.get("vision_config") or {}
        size, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
        full = mm.get("vision_feature_select_strategy", "default") == "full"
        return cls(
            image_token_id=int(mm.get("image_token_index", mm.get("image_token_id", 32000))),
            tokens_per_image=(size // patch) ** 2 + full,
            pixel_shape=(int(vision.get("num_channels", 3)), size, size),
        )
