#!/usr/bin/env bash
# Builds .device/ here: what a lent GPU machine lacks to run scripts/device/check_cuda.sh.
# Needs the project's .venv (make install). See scripts/device/README.md.
#   .device/gguf.part00, gguf.part01  the default model's GGUF in two halves (one call carries
#                                     at most 64 MiB, the file is about 94 MiB)
#   .device/gguf.name, gguf.sha256    its file name and checksum
#   .device/wheels/                   Python 3.12 wheels of the packages the machine's image lacks,
#                                     at the versions installed here
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
out=.device
rm -rf "$out"
mkdir -p "$out/wheels"

gguf=$($py -c 'from sluice.model.loader import default_model_path; print(default_model_path())')
split -n 2 -d "$gguf" "$out/gguf.part"
basename "$gguf" >"$out/gguf.name"
sha256sum "$gguf" | cut -d' ' -f1 >"$out/gguf.sha256"

# the image has torch, transformers, tokenizers, safetensors, numpy, jinja2, psutil, httpx,
# prometheus-client, pytest (scripts/device/README.md); sluice needs these beside them, with
# their own needs at the versions they ask (the image's may be older), pure Python but four
packages=(gguf msgspec pyzmq setproctitle fastapi starlette pydantic pydantic-core
  annotated-types typing-inspection uvicorn opentelemetry-api annotated-doc typing-extensions
  click h11 anyio)
pins=$($py - "${packages[@]}" <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
PY
)
# shellcheck disable=SC2086
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out/wheels" $pins
du -sh "$out"/gguf.part* "$out/wheels"
echo "built $out for: $pins"
