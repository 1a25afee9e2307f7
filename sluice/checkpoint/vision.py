"""ImageSlots: how a vision-language checkpoint's images sit in its token sequence, from
config.json alone (no torch), for the HTTP process (placeholder expansion) and the scheduler
(checking what arrives).

An image reaches the model as one or more tiles, each a run of `tokens_per_tile` positions
(one `ImageItem` on the wire, one `ImageSpan` in the scheduler) and pixels of `tile_shape`:

- LLaVA ("whole"): an image is one tile, `(image_size // patch_size) ** 2` positions (one per
  CLIP patch), one more under the "full" feature strategy (the class token kept). The defaults
  are those of LLaVA-1.5's CLIP ViT-L/14-336, which its config.json leaves out (as
  `sluice.model.models.clip.CLIPVisionConfig`'s).
- Idefics3 / SmolVLM ("grid"): the processor splits an image into a grid of tiles plus the
  global image, each `((image_size // patch_size) // scale_factor) ** 2` positions, with text
  tokens between them (`sluice.tokenizer.image_grid`). Defaults as transformers' configs.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.checkpoint.model_config import ModelConfig

GRID_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


@dataclass(frozen=True)
class ImageSlots:
    image_token_id: int  # the placeholder the prompt holds, one per image before expansion
    tokens_per_tile: int  # positions one tile takes once expanded
    tile_shape: tuple[int, int, int]  # [C, H, W] of one tile of the processor's pixel_values
    tiling: str = "whole"  # "whole": an image is one tile; "grid": tiles and a global image

    @classmethod
    def of(cls, cfg: ModelConfig) -> ImageSlots | None:
        """None for a text-only model."""
        mm = cfg.multimodal
        if mm is None:
            return None
        vision = mm.get("vision_config") or {}
        if cfg.architecture in GRID_ARCHITECTURES:
            size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
            scale = int(mm.get("scale_factor", 2))
            return cls(
                image_token_id=int(mm.get("image_token_id", 128257)),
                tokens_per_tile=(size // patch // scale) ** 2,
                tile_shape=(int(vision.get("num_channels", 3)), size, size),
                tiling="grid",
            )
        size, patch = int(vision.get("image_size", 336)), int(vision.get("patch_size", 14))
        full = mm.get("vision_feature_select_strategy", "default") == "full"
        return cls(
            image_token_id=int(mm.get("image_token_index", mm.get("image_token_id", 32000))),
            tokens_per_tile=(size // patch) ** 2 + full,
            tile_shape=(int(vision.get("num_channels", 3)), size, size),
        )
