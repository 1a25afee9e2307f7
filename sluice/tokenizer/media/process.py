"""Image bytes → the model's pixel_values, in one call of a media worker: decode (decode.py),
then the checkpoint's own image processor (transformers' `AutoImageProcessor`, loaded once per
worker process), so the pixels cross processes once, already processed.
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
    pixel_values: np.ndarray  # [C, H, W] float32, C-contiguous

    @property
    def nbytes(self) -> int:
        return self.pixel_values.nbytes


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
    try:
        out = processor(images=[decoded.pixels], return_tensors="np")["pixel_values"]
    except Exception as exc:
        raise MediaError(f"image_url: the image processor failed on the image ({exc})") from None
    pixel_values = np.ascontiguousarray(np.asarray(out[0], dtype=np.float32))
    return ProcessedImage(image_hash, pixel_values)
