"""EncoderRunner: owns an encoder's weights and turns a batch of token sequences into vectors.

Runs inside the scheduler process of an encoder model. No KV cache: each call is one
bidirectional forward over the batch's tokens packed back to back (no padding but in attention). Embedding models return the pooled (and, when
the model says so, L2-normalized) vector of each sequence; cross-encoders return their scores
(the classifier's logits after the config's activation).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from sluice.checkpoint.encoder_config import EncoderConfig
from sluice.model.loader import iter_hf_weights
from sluice.model.models.bert import (
    BertForSequenceClassification,
    BertModel,
    PackedLayout,
    pool,
)

logger = logging.getLogger(__name__)


class EncoderRunner:
    def __init__(self, cfg: EncoderConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.model = load_encoder(cfg, device, dtype)

    @property
    def output_dim(self) -> int:
        return self.cfg.num_labels if self.cfg.is_cross_encoder else self.cfg.hidden_size

    @torch.inference_mode()
    def forward(
        self, seqs: list[list[int]], token_types: list[list[int] | None] | None = None
    ) -> torch.Tensor:
        """[B, output_dim] float32, row i for `seqs[i]`."""
        ids, types, layout = self._pack(seqs, token_types)
        if self.cfg.is_cross_encoder:
            return _activate(self.model(ids, types, layout).float(), self.cfg.score_activation)
        hidden = self.model(ids, types, layout)  # [T, hidden]
        vectors = pool(hidden, layout, self.cfg.pooling).float()
        return F.normalize(vectors, p=2, dim=-1) if self.cfg.normalize else vectors

    def _pack(
        self, seqs: list[list[int]], token_types: list[list[int] | None] | None
    ) -> tuple[torch.Tensor, torch.Tensor, PackedLayout]:
        """Packed ids and token types [T], and the layout of the sequences in them."""
        ids = torch.tensor([t for seq in seqs for t in seq], dtype=torch.long)
        types = torch.zeros_like(ids)
        if token_types is not None and any(token_types):
            flat = [
                t for seq, tt in zip(seqs, token_types, strict=True) for t in (tt or [0] * len(seq))
            ]
            types = torch.tensor(flat, dtype=torch.long)
        layout = PackedLayout.of([len(s) for s in seqs], self.device)
        return ids.to(self.device), types.to(self.device), layout


def _activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits


def load_encoder(
    cfg: EncoderConfig, device: torch.device, dtype: torch.dtype
) -> BertModel | BertForSequenceClassification:
    start = time.perf_counter()
    with torch.device("meta"):
        model = BertForSequenceClassification(cfg) if cfg.is_cross_encoder else BertModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(iter_hf_weights(cfg.hf_dir))
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %.0fM parameters, %s pooling%s, %s on %s) in %.1f s",
        cfg.model_name, cfg.architecture, num_params / 1e6, cfg.pooling,
        ", normalized" if cfg.normalize else "", str(dtype).removeprefix("torch."), device,
        time.perf_counter() - start,
    )  # fmt: skip
    return model
