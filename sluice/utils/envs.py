"""The one registry of environment variables read by sluice.

Every variable sluice reads is declared in `ENV_VARS` with its default and a help line; the typed
getters below refuse undeclared names, so `ENV_VARS` is the complete list. Values are read when a
getter is called, never at import, so tests may set variables with `monkeypatch.setenv`.
To add a variable: add an entry to `ENV_VARS` (and a small named getter if it is read in several
places).
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    default: str | None  # as the string the variable would hold; None: unset
    help: str


ENV_VARS: dict[str, EnvVar] = {
    "SLUICE_CACHE_DIR": EnvVar(
        "~/.cache/sluice", "where converted models and other derived files are cached"
    ),
    "SLUICE_CPU_KERNELS": EnvVar(
        "1",
        "build and use sluice's C++ CPU kernels (attention, linear layers of a few rows, fused "
        "norm, SiLU, rotary); 0: PyTorch ops only",
    ),
    "SLUICE_KERNEL_POOL": EnvVar(
        "0",
        "1: the CPU kernels split their work with sluice's own thread pool (kernels/parallel.h), "
        "which never waits for a thread that another process holds, instead of OpenMP, and the "
        "scheduler's OpenMP threads sleep at once (--omp-wait-policy auto). For machines whose "
        "cores other work shares: beside one busy process it served a single stream at 116.6 "
        "tok/s against OpenMP's 2.3, on a quiet 2-core machine about 0.8x (benchmarks/README.md)",
    ),
    "SLUICE_QUANT_INT8_ACT": EnvVar(
        "1",
        "block-weight layers (GGUF Q8_0/Q4_0/Q4_1, --quantization gguf/int8/int4) with bfloat16 "
        "activations round them to int8 per block of 32 and use integer dot products (VNNI); 0: "
        "the float path (float32 activations always take it)",
    ),
    "SLUICE_FUSED_DECODE": EnvVar(
        "1",
        "decode steps of up to 8 rows through a model whose linear layers are GGUF blocks run "
        "all decoder layers in one C++ call (sluice.model.fused_decode); 0: layer by layer",
    ),
    "SLUICE_AMX_LINEAR": EnvVar(
        "1",
        "on CPUs with AMX, bfloat16 linear layers take batches of 17 rows or more (prefills, "
        "larger decode batches) through sluice's AMX GEMM, a gate_up projection with its SiLU "
        "in the same pass; 0: oneDNN's GEMM, and GGUF blocks' integer GEMM up to 32 rows (read "
        "when a layer is made)",
    ),
    "SLUICE_CUDA_SDPA": EnvVar(
        "flash,efficient,math",
        "the attention kernels PyTorch's SDPA may choose from on CUDA, comma-separated, of "
        "cudnn, flash, efficient, math (cuDNN is left out by default: it plans anew for every "
        "new shape, and a serving engine's shapes change every step)",
    ),
    "SLUICE_UVLOOP": EnvVar(
        "1",
        "the HTTP processes run their event loop on uvloop when it is installed (it comes with "
        "uvicorn[standard]); 0: asyncio's own loop",
    ),
    "OMP_WAIT_POLICY": EnvVar(
        None,
        "OpenMP's own: read by the scheduler process before it sets its own policy "
        "(--omp-wait-policy auto leaves a value given here as it is)",
    ),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    if name not in ENV_VARS:
        raise KeyError(f"environment variable {name} is not declared in sluice.utils.envs.ENV_VARS")
    value = os.environ.get(name)
    return ENV_VARS[name].default if value is None else value


def get_str(name: str) -> str | None:
    return _raw(name)


def get_bool(name: str) -> bool:
    value = (_raw(name) or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def get_path(name: str) -> Path | None:
    value = _raw(name)
    return None if not value else Path(value).expanduser()


def cache_dir() -> Path:
    """Root of sluice's cache (converted GGUF models, test references); not created here."""
    path = get_path("SLUICE_CACHE_DIR")  # None when set to ""
    return path or Path(ENV_VARS["SLUICE_CACHE_DIR"].default or "").expanduser()


def describe(width: int = 78) -> str:
    """Each declared variable: its name, default and current value, then its help indented
    (for the --help epilogue and logs)."""
    blocks = []
    for name, var in sorted(ENV_VARS.items()):
        value = os.environ.get(name)
        now = "unset" if value is None else f"set to {value!r}"
        indent = " " * 6
        help_text = textwrap.fill(var.help, width, initial_indent=indent, subsequent_indent=indent)
        blocks.append(f"  {name} (default {var.default!r}; {now})\n{help_text}")
    return "\n".join(blocks)
