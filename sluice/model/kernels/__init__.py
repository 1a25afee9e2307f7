"""sluice's own CPU kernels (`cpu_ops.cpp`), compiled with torch's C++ extension builder once per
machine and source.

`cpu_ops()` returns the compiled module, or None when it cannot be had (no compiler or ninja, a
build error, or SLUICE_CPU_KERNELS=0): callers then use PyTorch ops. Its functions:
`decode_attention(q, k_pool, v_pool, kv_indices, seq_lens, scale, shared_prefix=0,
shared_requests=None)` (a shared_prefix: that many first slots that every request, or those
shared_requests names, reads alike, attended all together; see cpu_ops.cpp) and `extend_attention(q,
k_pool, v_pool, kv_indices, q_rows, q_lens, scale, shared_prefix=0, shared_requests=None)` (the
same shared prefix, under each member request's new tokens) (for the head dims in its
`attention_head_dims`), `dense_attention_(out, q, k_pool, v_pool, kv_indices, spans, scale)` (in
place: an extend's long requests, causal, on AMX tiles; bfloat16, head_dim 64 or 128, q's rows
at any stride, only where `amx_attention()` is true: a build with AMX tiles, on a CPU whose
kernel lets the process use them), a bfloat16 GEMM on AMX tiles where `amx_linear_ok()` (the
same condition): `amx_pack_linear(w)` lays out a weight once and `amx_linear(x, packed, N, bias=None,
silu_mul=False)` computes x w^T + bias (with silu_mul, silu(gate) * up of a gate_up weight whose
rows alternate 16 gate and 16 up rows), `rms_norm(x, weight, eps)`, `add_rms_norm_(x, residual, weight, eps)`,
`silu_and_mul(x)`, `rope_(x, positions, cos, sin, heads, head_dim)` and `small_linear(x, w,
bias=None)` (up to `small_linear_max_rows` rows, in_features a multiple of
`small_linear_k_multiple`), for float32 and bfloat16
tensors on the CPU; results equal PyTorch's up to rounding, for finite inputs. For the sampler's
grammar masks, on float32 logits and int32 bitmasks: `masked_argmax(logits, masks, rows=None)`
and `grammar_mask_(logits, masks, rows=None)` (exact: the same tokens and values as adding
`sluice.model.sampler.grammar_bias`); `argmax_rows(logits)` for the greedy rows (the
first index of the maximum, as torch.argmax for logits without NaN), `finite_rows(logits)`,
and both in one pass, `greedy_rows(logits)` (the argmax, or -1 for a row with an infinity or
NaN), on float32 or bfloat16 logits. `store_kv_(k_pool, v_pool, loc, k, v)` writes a step's K
and V rows (at any row stride) into the pools at slots `loc`, as index_copy_ does, in any dtype
(KVCache.write). `DecodeLayers`
runs a llama decoder stack with GGUF block weights over a decode step in one call
(sluice.model.fused_decode), once `quant_ops()` has handed it its linear layers.

Build cache: `<cache dir>/kernels/<name>-<key>/`, the key a hash of everything the binary
depends on (the source's bytes, the compiler flags, torch's and Python's versions, the CPU model
and instruction sets), so two checkouts or installs of the same source share one build and
different sources never overwrite each other's. A folder exists only complete: the build runs in
a temporary folder (under a file lock, so concurrent processes build once) that is renamed into
place at the end. An existing folder is loaded directly with importlib, without torch's builder
(whose own checks would rebuild when, say, the checkout path differs). The build (about 30 s on
2 cores) is logged at INFO before and after; a reuse only at DEBUG.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sluice.utils import envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")  # its local includes: parallel.h
QUANT_SOURCE = Path(__file__).with_name("quant_ops.cpp")  # GGUF block weights (sluice.model.quant)
BUILD_LOCK_TIMEOUT_S = 300.0  # another process building the same kernel
BUILD_INFO = (
    "sluice-build.json"  # written last into a build folder: the module name, the key's parts
)
# vectorized float reductions need reassociation; no -ffast-math (NaN and inf keep their meaning)
CFLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros",
)  # fmt: skip
LDFLAGS = ("-fopenmp",)  # tuples: torch's builder appends to the lists it is given


@functools.cache
def cpu_ops() -> Any | None:
    """The compiled module of sluice's CPU kernels, or None. Its work is split by OpenMP
    (at::parallel_for), or by the thread pool of parallel.h when `pool_wanted()`."""
    ops = _optional_build("sluice_cpu_ops", SOURCE, "C++ CPU kernels", "; using PyTorch ops")
    if ops is not None and pool_wanted():
        ops._pool_enable(True)
        logger.info("SLUICE_KERNEL_POOL: the CPU kernels split their work with sluice's pool")
    return ops


def pool_wanted() -> bool:
    return envs.get_bool("SLUICE_KERNEL_POOL")


@functools.cache
def quant_ops() -> Any | None:
    """The compiled module of the quantized-weight kernels (`quant_ops.cpp`: `quant_linear(x, w,
    type, bias=None, int8_activations=False)`, `dequantize(w, type, K, dtype)`, the ggml type ids
    in `types`, those the integer path takes in `int8_types` and its instruction set in
    `int8_isa`; `interleave(w, type, K)` and `gguf_blocks(w, type, K)` to and from the
    row-interleaved layout of the types in `interleaved_types`, ggml id -> the layout's id),
    built and cached as
    `cpu_ops()`; None when it cannot be had. It runs its work on `cpu_ops()`'s thread pool
    (`parallel.h`), so that the process has one set of workers."""
    module = _optional_build("sluice_quant_ops", QUANT_SOURCE, "quantized-weight kernels", "")
    ops = cpu_ops() if module is not None else None
    if ops is not None and not module._pool_adopt(ops._pool_capsule()):
        logger.warning("the kernel modules' thread pools differ; each keeps its own")
    if ops is not None and not ops._adopt_quant_linear(module._linear_capsule()):
        logger.warning("cpu_ops does not take quant_ops' linear layers: no fused decode")
    return module


def _optional_build(name: str, source: Path, what: str, fallback: str) -> Any | None:
    """`_build`, or None when SLUICE_CPU_KERNELS is off or the build fails (logged once)."""
    if not envs.get_bool("SLUICE_CPU_KERNELS"):
        return None
    try:
        return _build(name, source)
    except Exception as e:  # any build failure: fall back, loudly once
        logger.warning("sluice's %s are unavailable (%s)%s", what, e, fallback)
        return None


def ensure_built() -> Any | None:
    """`cpu_ops()`, saying how it went: for a start-up hook (a test session's) that wants the
    one-time build done up front rather than inside the first model load."""
    start = time.perf_counter()
    ops = cpu_ops()
    took = time.perf_counter() - start
    if ops is None:
        logger.info("sluice's CPU kernels: not in use (%.1f s); PyTorch ops instead", took)
    else:
        logger.info("sluice's CPU kernels: ready in %.1f s", took)
    return ops


def _build(name: str, source: Path, extra_cflags: tuple[str, ...] = ()) -> Any:
    """The module `name` compiled from `source`, from its build folder if that exists, else built
    now; the tests also build a variant with `-DSLUICE_LANES=8`, the vector width of CPUs
    without AVX-512."""
    files = build_files(source)
    cflags = [*CFLAGS, *extra_cflags]
    folder = build_folder(name, _key_bytes(files), cflags)
    module = _load_built(folder)
    if module is not None:
        logger.debug("reusing the CPU kernels %s from %s", name, folder)
        return module
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.with_name(f"{folder.name}.lock")):
        module = _load_built(folder)  # another process built it while this one waited
        if module is None:
            module = _compile(name, files, cflags, folder)
    return module


def build_files(source: Path) -> dict[str, bytes]:
    """The bytes of `source` (first) and of the headers next to it that it includes with
    `#include "name"` (not recursively: the headers include none), by file name."""
    code = source.read_bytes()
    files = {source.name: code}
    for header in re.findall(rb'^#include "([^"/]+)"', code, flags=re.MULTILINE):
        files[header.decode()] = (source.parent / header.decode()).read_bytes()
    return files


def _key_bytes(files: dict[str, bytes]) -> bytes:
    """What the build key hashes of `files`: the source's bytes alone when it includes nothing
    (so such a key is a hash of the source as before), else each file's name and bytes."""
    if len(files) == 1:
        return next(iter(files.values()))
    return b"".join(b"\0" + name.encode() + b"\0" + code for name, code in files.items())


def build_folder(name: str, code: bytes, cflags: Sequence[str]) -> Path:
    """Where the build of `code` (a C++ source's bytes) with `cflags` lives for this torch,
    Python and CPU."""
    import torch

    key = build_key(
        code, [*cflags, "--ldflags", *LDFLAGS, "--cxx", os.environ.get("CXX", "c++")],
        torch.__version__, sys.implementation.cache_tag, _cpu_fingerprint(),
    )  # fmt: skip
    return envs.cache_dir() / "kernels" / f"{name}-{key}"


def build_key(code: bytes, flags: Sequence[str], torch_version: str, python: str, cpu: str) -> str:
    """A short hash of everything a build depends on (-march=native: the CPU's instruction sets)."""
    digest = hashlib.sha256(code)
    for part in (json.dumps(list(flags)), torch_version, python, cpu):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _load_built(folder: Path) -> Any | None:
    """The module of a finished build folder, imported as it is; None when there is none, or
    when it does not load (a deleted or truncated .so, a changed system library): the caller
    then builds it again in its place."""
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
    import torch  # noqa: F401  (the module links against the libraries torch loads)

    try:
        name = info["module"]
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.so")
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {folder / name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, KeyError, TypeError) as e:
        logger.warning(
            "the CPU kernels built in %s do not load (%s); building them again", folder, e
        )
        return None
    return module


def _compile(name: str, files: dict[str, bytes], cflags: Sequence[str], folder: Path) -> Any:
    """Build `files` (the source first, then its headers) in a fresh temporary folder next to
    `folder`, then rename it into place; the caller holds the folder's lock."""
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH: use the pip package's
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    logger.info(
        "building sluice's CPU kernels %s (about 30 s, once per machine and source) in %s",
        name, folder,
    )  # fmt: skip
    start = time.perf_counter()
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):  # of a build that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # as any other cache folder, not mkdtemp's 0o700
        for filename, code in files.items():  # exactly the bytes the key hashed
            (tmp / filename).write_bytes(code)
        module = load(
            name=name, sources=[str(tmp / next(iter(files)))], extra_cflags=list(cflags),
            extra_ldflags=list(LDFLAGS), build_directory=str(tmp), verbose=False,
        )  # fmt: skip
        info = {
            "module": module.__name__,
            "flags": list(cflags),
            "built_s": time.perf_counter() - start,
        }
        (tmp / BUILD_INFO).write_text(json.dumps(info))
        if folder.exists():  # a folder without its info file: not a finished build
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("built the CPU kernels %s in %.1f s", name, time.perf_counter() - start)
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
    """This CPU's model and instruction-set flags (Linux), else its arch."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))][:2]
    return "\n".join(lines) or platform.machine()
