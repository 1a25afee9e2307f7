"""The HTTP process's image input: fetch under a safety policy, decode under limits, cache by hash.

`MediaManager.load_images(urls)` (decoded pixels) and `process_images(urls)` (the checkpoint's
image processor run on them, for a vision-language model) are the entry points; every refusal is
a `MediaError` (a 400 `RequestError` whose message says why, with the numbers).
"""

from __future__ import annotations

from sluice.tokenizer.media.decode import FORMATS, DecodedImage
from sluice.tokenizer.media.manager import ImageCache, MediaManager
from sluice.tokenizer.media.policy import MediaError, MediaPolicy
from sluice.tokenizer.media.process import ProcessedImage

__all__ = [
    "FORMATS", "DecodedImage", "ImageCache", "MediaError", "MediaManager", "MediaPolicy",
    "ProcessedImage",
]  # fmt: skip
