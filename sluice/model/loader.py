"""Reading a checkpoint's weights: the safetensors of a Hugging Face directory (as
`sluice.checkpoint.hf_dir.prepare_hf_dir` gives it, a GGUF's conversion included) into tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


def iter_hf_weights(hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors shard of `hf_dir`, shard by shard."""
    from safetensors import safe_open

    root = Path(hf_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        paths = [root / name for name in files]
    else:
        paths = sorted(root.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
