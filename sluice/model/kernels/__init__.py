"""sluice's own CPU kernels (`cpu_ops.cpp`), compiled once per machine with torch's C++
extension builder.

`cpu_ops()` returns the compiled module, or None when it cannot be had (no compiler or ninja, a
build error, or SLUICE_CPU_KERNELS=0): callers then use PyTorch ops. Its functions:
`decode_attention(q, k_pool, v_pool, kv_indices, seq_lens, scale)` and `extend_attention(q,
k_pool, v_pool, kv_indices, q_rows, q_lens, scale)` (for the head dims in its
`attention_head_dims`), `rms_norm(x, weight, eps)`, `add_rms_norm_(x, residual, weight, eps)`,
`silu_and_mul(x)`, `rope_(x, positions, cos, sin, heads, head_dim)` and `small_linear(x, w,
bias=None)` (up to `small_linear_max_rows` rows, in_features a multiple of
`small_linear_k_multiple`), for float32 and bfloat16
tensors on the CPU; results equal PyTorch's up to rounding, for finite inputs. The build (about
30 s on 2 cores) lands in `<cache dir>/kernels/<name>-<CPU fingerprint>/` and is reused by every
later process on a CPU of the same kind; the C++ source is part of the package.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sluice.utils import envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
BUILD_LOCK_TIMEOUT_S = 300.0  # another process building the same kernel
# vectorized float reductions need reassociation; no -ffast-math (NaN and inf keep their meaning)
CFLAGS = [
    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros",
]  # fmt: skip


@functools.cache
def cpu_ops() -> Any | None:
    """The compiled module of sluice's CPU kernels, or None."""
    if not envs.get_bool("SLUICE_CPU_KERNELS"):
        return None
    try:
        return _build("sluice_cpu_ops", SOURCE)
    except Exception as e:  # any build failure: fall back, loudly once
        logger.warning("sluice's C++ CPU kernels are unavailable (%s); using PyTorch ops", e)
        return None


def _build(name: str, source: Path, extra_cflags: tuple[str, ...] = ()) -> Any:
    """Compile (or reuse) `source` as the Python module `name`; the tests also build a variant
    with `-DSLUICE_LANES=8`, the vector width of CPUs without AVX-512."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH: use the pip package's
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    # -march=native: a build is only good for CPUs with the same instruction sets
    build_dir = envs.cache_dir() / "kernels" / f"{name}-{_cpu_fingerprint()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir / "sluice-build.lock"):
        # torch's own `lock` file outlives a build that was killed and then blocks every later
        # one forever; holding our lock (the OS drops it with its process) proves it stale
        (build_dir / "lock").unlink(missing_ok=True)
        fresh = not any(build_dir.glob("*.so"))
        if fresh:
            logger.info("building the CPU kernels %s (once per machine, ~30 s)", name)
        start = time.perf_counter()
        module = load(
            name=name, sources=[str(source)], extra_cflags=[*CFLAGS, *extra_cflags],
            extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False,
        )  # fmt: skip
    if fresh:
        logger.info("built %s in %.1f s", name, time.perf_counter() - start)
    return module


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An advisory lock on `path`, waited for at most BUILD_LOCK_TIMEOUT_S (TimeoutError)."""
    with open(path, "a") as f:
        deadline = time.monotonic() + BUILD_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process holds {path}") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags (Linux), else of its arch."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))][:2]
    text = "\n".join(lines) or platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:12]
