"""BERT encoder: embedding models (BertModel + pooling) and cross-encoders
(BertForSequenceClassification). Parameter names follow the Hugging Face checkpoints.

Inputs are packed: the tokens of B sequences back to back, [T] ids, token types and positions,
so every linear layer and LayerNorm runs on real tokens only. Only attention sees a padded
[B, L] view (`PackedLayout`), with padded keys masked out: a sequence's states do not depend on
what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.checkpoint.encoder_config import EncoderConfig

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
# checkpoint tensors that have no place in an encoder at inference (MLM heads, buffers)
_SKIPPED_PREFIXES = ("cls.", "embeddings.position_ids", "bert.embeddings.position_ids")


@dataclass(frozen=True)
class PackedLayout:
    """Where B packed sequences sit: token t is row `index[t]` of the flat [B * L] padded view."""

    index: torch.Tensor  # [T] long
    seq_ids: torch.Tensor  # [T] long: the sequence of each token
    starts: torch.Tensor  # [B] long: first token of each sequence in the packed rows
    lens: torch.Tensor  # [B] long
    mask: torch.Tensor  # [B, L] bool: True on real tokens

    @classmethod
    def of(cls, lens: list[int], device: torch.device) -> PackedLayout:
        num, longest = len(lens), max(lens)
        lens_t = torch.tensor(lens, dtype=torch.long)
        seq_ids = torch.repeat_interleave(torch.arange(num), lens_t)  # [T]
        starts = torch.cumsum(lens_t, 0) - lens_t  # [B]
        offsets = torch.arange(int(lens_t.sum())) - starts[seq_ids]  # [T]: position in sequence
        mask = torch.arange(longest)[None, :] < lens_t[:, None]  # [B, L]
        return cls(
            (seq_ids * longest + offsets).to(device), seq_ids.to(device), starts.to(device),
            lens_t.to(device), mask.to(device),
        )  # fmt: skip

    @property
    def positions(self) -> torch.Tensor:
        return self.index - self.seq_ids * self.mask.shape[1]  # [T]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))  # [T, hidden]


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        b, length = layout.mask.shape
        hidden = x.shape[-1]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [B, heads, L, head_dim]
            padded = t.new_zeros(b * length, hidden).index_copy_(0, layout.index, t)
            return padded.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=layout.mask[:, None, None, :], scale=1 / math.sqrt(self.head_dim)
        )  # [B, heads, L, head_dim]
        return out.transpose(1, 2).reshape(b * length, hidden)[layout.index]  # [T, hidden]


class BertSelfOutput(nn.Module):
    """Projection, then the residual and LayerNorm (the name HF gives both sublayer outputs)."""

    def __init__(self, cfg: EncoderConfig, in_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        return self.output(self.self(x, layout), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported")
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))  # [T, intermediate]


class BertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        x = self.attention(x, layout)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertPooler(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[layout.starts]))  # [B, hidden] from the CLS states


class BertModel(nn.Module):
    """Token states [T, hidden]; the pooler exists only under a classifier."""

    def __init__(self, cfg: EncoderConfig, add_pooler: bool = False) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if add_pooler else None

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids, layout.positions)
        for layer in self.encoder.layer:
            x = layer(x, layout)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self, weights, strip="bert.")


class BertForSequenceClassification(nn.Module):
    """Cross-encoder: logits [B, num_labels] from the pooled CLS state."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.bert = BertModel(cfg, add_pooler=True)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        hidden = self.bert(input_ids, token_type_ids, layout)
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(hidden, layout))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named(self, weights, strip=None)


def pool(hidden: torch.Tensor, layout: PackedLayout, mode: str) -> torch.Tensor:
    """One vector per sequence [B, hidden] from packed token states [T, hidden] (float32 mean)."""
    if mode == "cls":
        return hidden[layout.starts]
    if mode == "last":
        return hidden[layout.starts + layout.lens - 1]
    num = layout.lens.shape[0]
    total = hidden.new_zeros(num, hidden.shape[-1], dtype=torch.float32)
    total.index_add_(0, layout.seq_ids, hidden.float())
    return total / layout.lens[:, None].to(torch.float32)


@torch.no_grad()
def load_named(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], strip: str | None
) -> None:
    """Copy checkpoint tensors by name; every parameter must be filled, extras are ignored only
    when they are heads or buffers this model does not have (MLM head, unused pooler)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if strip and name.startswith(strip):
            name = name[len(strip) :]
        if name.startswith(_SKIPPED_PREFIXES) or (
            name.startswith("pooler.") and name not in params
        ):
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                f"model {tuple(params[name].shape)}"
            )
        params[name].copy_(tensor.to(params[name].dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
