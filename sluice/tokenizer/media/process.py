"""Image bytes → the model's pixel_values, in one call of a media worker: decode (decode.py),
then the checkpoint's own image processor (transformers' `AutoImageProcessor`, loaded once per
worker process), so the pixels cross processes once, already processed.

A processor that splits images into tiles (Idefics3's and SmolVLM's: `do_image_splitting`)
gives every tile of the image, and the grid it cut them in (`ProcessedImage.grid`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice.tokenizer.media.decode import decode_image
from sluice.tokenizer.media.policy import MediaError

# per worker process: model dir -> its image processor (a worker serves one model)
_processors: dict[str, Any] = {}


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model takes it; `hash` (sha256 of its bytes, hex) is its identity."""

    hash: str
    pixel_values: np.ndarray  # [C, H, W] (one tile) or [tiles, C, H, W]; float32, C-contiguous
    # (rows, cols) of the tiles a splitting processor cut, the global image after them;
    # (0, 0): not split (the image is one tile)
    grid: tuple[int, int] = (0, 0)

    @property
    def nbytes(self) -> int:
        return self.pixel_values.nbytes

    @property
    def tiles(self) -> np.ndarray:
        """[tiles, C, H, W]"""
        pixels = self.pixel_values
        return pixels[None] if pixels.ndim == 3 else pixels


def load_image_processor(model_dir: str) -> Any:
    """The checkpoint's image processor; raises ValueError when it has none."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_dir)
    except Exception as exc:
        raise ValueError(f"{model_dir}: no image processor could be loaded ({exc})") from exc


def process_image(data: bytes, image_hash: str, max_pixels: int, model_dir: str) -> ProcessedImage:
    """Decode `data` and run the processor; every failure is a MediaError (picklable)."""
    decoded = decode_image(data, image_hash, max_pixels)
    processor = _processors.get(model_dir)
    if processor is None:
        processor = _processors[model_dir] = load_image_processor(model_dir)
    splits = hasattr(processor, "do_image_splitting")
    kwargs = {"return_row_col_info": True} if splits else {}
    try:
        # decode_image gives [H, W, 3]: said, so that a 3-pixel-high image is not read as
        # channels-first (transformers guesses the layout from the shape otherwise)
        out = processor(
            images=[decoded.pixels], return_tensors="np", input_data_format="channels_last",
            **kwargs,
        )  # fmt: skip
        grid = (int(out["rows"][0][0]), int(out["cols"][0][0])) if splits else (0, 0)
    except Exception as exc:
        raise MediaError(f"image_url: the image processor failed on the image ({exc})") from None
    # [C, H, W], or (a splitting processor) [tiles, C, H, W] of the one image of one sample
    pixel_values = np.ascontiguousarray(np.asarray(out["pixel_values"][0], dtype=np.float32))
    return ProcessedImage(image_hash, pixel_values, grid)
