"""VisionLanguageModel: what LLaVA and Idefics3 / SmolVLM share around their vision sides.

A subclass builds its vision modules and a Llama-family `language_model`, and says how its
vision side turns pixels into the features of an image's positions (`image_features`: pixels
[I, C, H, W] -> [I, positions per image, text hidden]). The runner computes (or finds cached) the
features of a forward's images into `mm_inputs.features`; here they replace the input embeddings
of the image positions, and the rest is the text model's forward, unchanged. A forward without
images is the text model's own.

Loading is one pass over the checkpoint (which streams shard by shard): each tensor's name is
mapped (`module_name`) to this module's; the language model's go to its own loader, the rest
are copied here, and a tensor with no place is an error unless `is_unused` says nothing reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from sluice.model.forward_batch import ForwardBatch, ForwardOutput
from sluice.model.kv_cache import KVCache
from sluice.model.models.llama import LlamaForCausalLM, _copy


class VisionLanguageModel(nn.Module):
    family = "a vision-language model"  # named in loading errors
    language_model: LlamaForCausalLM

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def module_name(self, checkpoint_name: str) -> str:
        """The name in this module of a tensor saved under `checkpoint_name`."""
        raise NotImplementedError

    def is_unused(self, name: str) -> bool:
        """A checkpoint tensor (by module name) that nothing reads: the position-id buffer some
        checkpoints store; subclasses add their own."""
        return name.endswith(".position_ids")

    def forward(self, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Returns logits [N, vocab] for the rows in `fb.logits_index` only."""
        return self.forward_output(fb, kv).logits

    def forward_output(self, fb: ForwardBatch, kv: KVCache) -> ForwardOutput:
        embeds = None if fb.mm_inputs is None else self._embed_with_images(fb)
        return self.language_model.forward_output(fb, kv, embeds)

    def _embed_with_images(self, fb: ForwardBatch) -> torch.Tensor:
        """Input embeddings [T, hidden]: the tokens', with the images' features in their rows."""
        mm = fb.mm_inputs
        assert mm is not None and mm.features is not None, "the runner fills mm_inputs.features"
        # placeholder ids may lie outside the vocabulary (ids made from image hashes)
        ids = fb.input_ids.index_fill(0, mm.dst_index, 0)
        embeds = self.language_model.model.embed_tokens(ids)  # [T, hidden]
        return embeds.index_copy(0, mm.dst_index, mm.features[mm.src_index].to(embeds.dtype))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {n: p for n, p in self.named_parameters() if not n.startswith("language_model.")}
        loaded: set[str] = set()

        def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for checkpoint_name, tensor in weights:
                name = self.module_name(checkpoint_name)
                if name.startswith("language_model."):
                    yield name.removeprefix("language_model."), tensor
                elif name in params:
                    _copy(params[name], tensor, checkpoint_name)
                    loaded.add(name)
                elif not self.is_unused(name):
                    raise KeyError(
                        f"checkpoint tensor {checkpoint_name!r} has no place in {self.family}"
                    )

        self.language_model.load_weights(language_weights())
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
