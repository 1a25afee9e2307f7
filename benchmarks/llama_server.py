"""Locate or build llama.cpp's ``llama-server`` for the serving benchmark.

The binary is built from the llama.cpp sources vendored in the ``llama-cpp-python`` source
distribution on PyPI, inside a cache directory outside the repository:
``$SLUICE_CACHE_DIR/llama.cpp`` or ``~/.cache/sluice/llama.cpp``. A finished build is reused.

Instruction sets are named explicitly (``GGML_NATIVE=OFF``, then each of AVX2, FMA, F16C,
AVX-512, its VNNI, VBMI and BF16 extensions, AVX-VNNI... as /proc/cpuinfo lists them), with AMX
always off: ``GGML_NATIVE=ON`` on a CPU with AMX compiles llama.cpp's AMX kernels, and
llama-server then dies with SIGILL (``tilezero`` in ``tinygemm_kernel_amx``) at its first forward.
The build folder is named after a hash of the options, so a build with other options (an older
native one, or one for another CPU) is never reused. Other architectures keep ``GGML_NATIVE=ON``.

    python benchmarks/llama_server.py          # build if needed, print the binary's path
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# Wanted CMake options besides the instruction sets; only those the vendored version declares
# are passed.
CMAKE_OPTIONS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
}
ALWAYS_PASSED = {"CMAKE_BUILD_TYPE", "BUILD_SHARED_LIBS"}

# llama.cpp's x86 instruction-set options and the /proc/cpuinfo flags each needs: an option adds
# the compiler flags of its sets (ggml/src/ggml-cpu/CMakeLists.txt; GGML_AVX512 is -mavx512f,
# cd, vl, dq and bw together, and the AVX-512 extensions need it)
AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": AVX512,
    "GGML_AVX512_VBMI": (*AVX512, "avx512vbmi"),
    "GGML_AVX512_VNNI": (*AVX512, "avx512_vnni"),
    "GGML_AVX512_BF16": (*AVX512, "avx512_bf16"),
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")  # off on every CPU


def cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "sluice"
    return base / "llama.cpp"


def _log(msg: str) -> None:
    print(f"[llama_server] {msg}", file=sys.stderr, flush=True)


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The instruction-set flags of the first CPU in a /proc/cpuinfo text (None: no flags line)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return None


def isa_options(flags: set[str] | None, machine: str) -> dict[str, str]:
    """llama.cpp's instruction-set options for a CPU with `flags` (see `cpu_flags`): on x86-64
    every set named ON or OFF, GGML_NATIVE and AMX off; elsewhere (or unknown flags) native."""
    if machine.lower() not in ("x86_64", "amd64") or flags is None:
        return {"GGML_NATIVE": "ON"}
    options = {"GGML_NATIVE": "OFF"}
    for option, needs in X86_OPTIONS.items():
        options[option] = "ON" if flags.issuperset(needs) else "OFF"
    options.update(dict.fromkeys(AMX_OPTIONS, "OFF"))
    return options


def wanted_options() -> dict[str, str]:
    """Every CMake option wanted for this machine, before filtering by what llama.cpp declares."""
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = None
    return {**CMAKE_OPTIONS, **isa_options(flags, platform.machine())}


def build_name(options: dict[str, str]) -> str:
    """The build folder's name: a hash of the options, so no build is reused for others."""
    text = json.dumps(sorted(options.items()))
    return f"build-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def find_binary() -> Path | None:
    """An already built llama-server: $LLAMA_SERVER, the cache build with this machine's
    options, or one on PATH."""
    env = os.environ.get("LLAMA_SERVER")
    if env and Path(env).is_file():
        return Path(env)
    pattern = f"llama_cpp_python-*/vendor/llama.cpp/{build_name(wanted_options())}/bin/llama-server"
    built = sorted(cache_dir().glob(pattern))
    if built:
        return built[-1]
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def _download_sdist(dest: Path) -> Path:
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    _log(f"downloading the llama-cpp-python sdist into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    subprocess.run([*cmd, "llama-cpp-python", "-d", str(dest)], check=True)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise RuntimeError("pip download produced no llama_cpp_python sdist")
    return found[-1]


def _unpack(sdist: Path) -> Path:
    """Returns the vendored llama.cpp source directory."""
    top = sdist.parent / sdist.name.removesuffix(".tar.gz")
    src = top / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        _log(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(sdist.parent, filter="data")
    return src


def _declared_options(src: Path) -> set[str]:
    text = ""
    for path in (src / "CMakeLists.txt", src / "ggml" / "CMakeLists.txt"):
        if path.is_file():
            text += path.read_text(errors="replace")
    return set(re.findall(r"^\s*option\s*\(\s*(\w+)", text, flags=re.MULTILINE))


def _cmake_args(src: Path, options: dict[str, str]) -> list[str]:
    declared = _declared_options(src) | ALWAYS_PASSED
    dropped = sorted(k for k in options if k not in declared)
    if dropped:
        _log(f"options this llama.cpp does not declare, left out: {' '.join(dropped)}")
    return [f"-D{k}={v}" for k, v in options.items() if k in declared]


def build(jobs: int = 2) -> Path:
    """Builds llama-server (about 15 minutes on 2 cores) and returns its path."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = _unpack(_download_sdist(root))
    options = wanted_options()
    build_dir = src / build_name(options)
    nice = ["nice", "-n", "10"]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if options["GGML_NATIVE"] == "ON":
        _log("instruction sets: the compiler's -march=native")
    else:
        isa = [k.removeprefix("GGML_") for k in X86_OPTIONS if options[k] == "ON"]
        _log(f"instruction sets: {' '.join(isa) or 'none beyond x86-64'}; AMX off")
    cmake_args = _cmake_args(src, options)
    _log(f"configuring in {build_dir}: {' '.join(cmake_args)}")
    subprocess.run(
        [*nice, "cmake", "-S", str(src), "-B", str(build_dir), *gen, *cmake_args], check=True
    )
    _log(f"building llama-server with {jobs} jobs")
    target = ["--target", "llama-server", "-j", str(jobs)]
    subprocess.run([*nice, "cmake", "--build", str(build_dir), *target], check=True)
    binary = build_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise RuntimeError(f"build finished but {binary} is missing")
    return binary


def ensure_binary() -> Path:
    return find_binary() or build()


def main() -> None:
    print(ensure_binary())


if __name__ == "__main__":
    main()
