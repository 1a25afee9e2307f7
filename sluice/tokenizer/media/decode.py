"""Image bytes → RGB pixels, under a pixel limit. Runs in a worker of the media process pool.

Guarantee: nothing is decompressed before the dimensions in the header are checked against
`max_pixels` (Pillow's `Image.open` reads only the header; its own decompression-bomb guard stays
on as a second line). Only the formats in `FORMATS` are tried; an animated GIF, PNG or WebP gives
its first frame; EXIF orientation is applied and every mode is converted to RGB (alpha dropped),
as transformers' `load_image` does, so processors see the same pixels.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from sluice.tokenizer.media.policy import MediaError

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
_PILLOW_PIXELS = re.compile(r"\((\d+) pixels\)")


@dataclass(frozen=True)
class DecodedImage:
    """One decoded image; `hash` (sha256 of the bytes it came from, hex) is its identity."""

    hash: str
    format: str  # one of FORMATS
    pixels: np.ndarray  # [height, width, 3] uint8, RGB

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes

    @property
    def width(self) -> int:
        return self.pixels.shape[1]

    @property
    def height(self) -> int:
        return self.pixels.shape[0]


def format_mpixels(num_pixels: int) -> str:
    if num_pixels < 100_000:
        return f"{num_pixels} pixels"
    return f"{num_pixels / 1e6:.1f} Mpixels"


def _too_many_pixels(size: str, max_pixels: int) -> MediaError:
    return MediaError(
        f"image_url: the image is {size}, over the limit of {format_mpixels(max_pixels)} "
        "(--max-image-pixels)",
        code="image_too_large",
    )


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """The lazily opened image, its header checked; raises MediaError."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        found = _PILLOW_PIXELS.search(str(exc))
        size = format_mpixels(int(found.group(1))) if found else "too large to decode safely"
        raise _too_many_pixels(size, max_pixels) from None
    except Image.UnidentifiedImageError:
        raise MediaError(
            f"image_url: the data is not an image in a supported format ({', '.join(FORMATS)})"
        ) from None
    except Exception as exc:
        raise MediaError(f"image_url: the image header cannot be read ({exc})") from None
    width, height = image.size
    if width * height > max_pixels:
        size = f"{width}x{height} = {format_mpixels(width * height)}"
        raise _too_many_pixels(size, max_pixels)
    if width == 0 or height == 0:
        raise MediaError(f"image_url: the image is {width}x{height}, it has no pixels")
    return image


def decode_image(data: bytes, image_hash: str, max_pixels: int) -> DecodedImage:
    """Decode `data` to RGB; every failure is a MediaError (picklable, for the process pool)."""
    image = _open(data, max_pixels)
    kind = image.format or "unknown"
    try:
        image.seek(0)  # the first frame of an animation
        image = ImageOps.exif_transpose(image)
        rgb = image.convert("RGB")
        pixels = np.asarray(rgb, dtype=np.uint8)  # [height, width, 3]
    except Exception as exc:
        raise MediaError(f"image_url: the {kind} image cannot be decoded ({exc})") from None
    return DecodedImage(image_hash, kind, pixels)
