"""sluice's own CPU kernels, compiled once per machine with torch's C++ extension builder.

`decode_attention()` returns the compiled op, or None when it cannot be had (no compiler or
ninja, a build error, or SLUICE_CPU_KERNELS=0): callers then use the PyTorch path, which gives
the same results. The build (about 20 s on 2 cores) lands in `<cache dir>/kernels/` and is
reused by every later process; the C++ source is part of the package.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sluice.utils import envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
# vectorized float reductions need reassociation; no -ffast-math (NaN and inf keep their meaning)
CFLAGS = [
    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros",
]  # fmt: skip


@functools.cache
def decode_attention() -> Any | None:
    """The `decode_attention(q, k_pool, v_pool, kv_indices, seq_lens, scale)` op, or None."""
    if not envs.get_bool("SLUICE_CPU_KERNELS"):
        return None
    try:
        return _build("sluice_decode_attention", SOURCE).decode_attention
    except Exception as e:  # any build failure: fall back, loudly once
        logger.warning("the C++ decode-attention kernel is unavailable (%s); using PyTorch ops", e)
        return None


def _build(name: str, source: Path) -> Any:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH: use the pip package's
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"

    build_dir = envs.cache_dir() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.info("building the CPU kernel %s (once per machine, ~20 s)", name)
    start = time.perf_counter()
    module = load(
        name=name, sources=[str(source)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir), verbose=False,
    )  # fmt: skip
    if fresh:
        logger.info("built %s in %.1f s", name, time.perf_counter() - start)
    return module
