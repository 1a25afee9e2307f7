"""Locate or build llama.cpp's ``llama-server`` for the serving benchmark.

The binary is built from the llama.cpp sources vendored in the ``llama-cpp-python`` source
distribution on PyPI, inside a cache directory outside the repository:
``$SLUICE_CACHE_DIR/llama.cpp`` or ``~/.cache/sluice/llama.cpp``. A finished build is reused.

    python benchmarks/llama_server.py          # build if needed, print the binary's path
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# Wanted CMake options; only those the vendored version declares are passed.
CMAKE_OPTIONS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "ON",
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


def cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "sluice"
    return base / "llama.cpp"


def _log(msg: str) -> None:
    print(f"[llama_server] {msg}", file=sys.stderr, flush=True)


def find_binary() -> Path | None:
    """An already built llama-server: $LLAMA_SERVER, the cache build, or one on PATH."""
    env = os.environ.get("LLAMA_SERVER")
    if env and Path(env).is_file():
        return Path(env)
    built = sorted(cache_dir().glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
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


def _cmake_args(src: Path) -> list[str]:
    declared = _declared_options(src) | ALWAYS_PASSED
    return [f"-D{k}={v}" for k, v in CMAKE_OPTIONS.items() if k in declared]


def build(jobs: int = 2) -> Path:
    """Builds llama-server (about 15 minutes on 2 cores) and returns its path."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = _unpack(_download_sdist(root))
    build_dir = src / "build"
    nice = ["nice", "-n", "10"]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _log(f"configuring in {build_dir}")
    subprocess.run(
        [*nice, "cmake", "-S", str(src), "-B", str(build_dir), *gen, *_cmake_args(src)], check=True
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
