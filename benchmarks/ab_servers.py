"""Two or more sluice configurations against each other, interleaved trial by trial.

On the shared 2-core VMs this project measures on, the machine's own speed drifts by a third
within minutes (benchmarks/README.md), so two `serving.py` runs one after the other compare the
drift as much as the configurations. Here every configuration (a label, environment variables,
extra `sluice serve` flags) gets its own server, all of them up at once; then, per workload and
for `--rounds` rounds, each server runs one short trial (the workload's clients, one request
each, all sent together: one batch), in an order that alternates between rounds. The servers'
trials of a round get the same prompts, each after the machine is 90% idle again
(`wait_quiet`). Printed per configuration: the median output tok/s
(completion tokens / the trial's wall time) and the paired ratio to the first configuration's
trial of the same round (median, min, max): the figure to read, since drift falls on both
members of a pair alike. Each HTTP server's time to first token is paired the same way: its
trial's p99 (of the trial's requests, sent together: about the last one's, after the burst's
prefill) over the first configuration's, lower being better, and for a peer the first
configuration's over the peer's (issue 14's TTFT goal). While one member runs its trial, the
others are stopped (SIGSTOP, then SIGCONT; `--keep-others-running` leaves them be): an idle
sluice sleeps (its scheduler blocks on its sockets once its OpenMP threads have stopped
spinning), but an idle vLLM does not (`others_stopped`). With OpenMP's ACTIVE wait policy a
sluice's threads spin for ever, so such a configuration is refused.

    .venv/bin/python benchmarks/ab_servers.py --config "omp" \\
        --config "pool:SLUICE_KERNEL_POOL=1" [--config "label:ENV=V,ENV2=W:--flag value"] \\
        [--workloads single-stream,decode-heavy,mixed,shared-prefix] [--rounds 12] \\
        [--llama-server] [--vllm] [--engine]

A configuration is `label[:ENV=V,...[:sluice serve flags]]`; every server also gets
`--no-embedding-model` unless `--with-embedding-model`. The workloads are `serving.py`'s. To
compare two checkouts, give the other one as PYTHONPATH (`git worktree add /tmp/base REV`,
then `--config "base:PYTHONPATH=/tmp/base" --config new`): servers start with `python -P`, so
that tree's sluice is the one that runs, and each configuration's first line names the folder.

`--llama-server` adds llama.cpp's server (`llama_server.py`'s build, the same GGUF, serving.py's
flags) as one more member of every round, and prints the first configuration / llama-server by
pairs: issue 14's peer ratios, with the drift paired out. One configuration is then enough.
`--vllm` does the same with vLLM's CPU backend (`vllm_server.py`: its venv, made on first use,
the Hugging Face copy of the GGUF in bfloat16; about a minute to start). `--engine` adds this
checkout's in-process `sluice.Engine` (default arguments, no embedding model), in a subprocess
that runs each trial's requests with one `generate` call, and prints the first configuration /
Engine by pairs: issue 14's server / Engine ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serving import (  # noqa: E402
    DEFAULT_WORKLOADS,
    WARMUP_OUTPUT,
    WORKLOADS,
    ServerProcess,
    Workload,
    _drive,
    free_port,
    llama_command,
    make_prompts,
    percentile,
    run_loop,
    select_workloads,
    sluice_command,
    sluice_origin,
    timed_generate,
)

DEFAULT_CLIENTS = 32  # clients of a trial for the workloads that do not name their own
LLAMA = "llama-server"  # the peers' labels (`--llama-server`, `--vllm`)
VLLM = "vLLM-cpu"
QUIET_IDLE = 0.9  # share of the machine idle before each trial (`wait_quiet`)
ENGINE = "sluice-Engine"


class EngineMember:
    """The in-process Engine as a member of the rounds: a subprocess (`--engine-worker`) that
    takes one trial a line on stdin (JSON: token-id prompts and output length) and answers a
    line (output tokens and seconds of the one `generate` call that ran them together)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> EngineMember:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-worker"]
        print(f"starting {ENGINE}: {shlex.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )  # its own session: a terminal's Ctrl-C or Ctrl-Z reaches the benchmark, not it
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{ENGINE} did not start (exit {self.proc.poll()}): {line!r}")
        print(f"{ENGINE} ready", flush=True)
        return self

    def trial(self, prompts: list, output_len: int) -> float:
        """Output tok/s of running `prompts` together, each to `output_len` tokens."""
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{ENGINE} exited ({self.proc.wait()})")
        result = json.loads(line)
        if result["wrong"]:
            raise RuntimeError(f"{ENGINE}: {result['wrong']} requests ended short")
        return result["tokens"] / result["seconds"]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve_trials(engine: Any, lines: Iterable[str], out: TextIO) -> None:
    """The worker's loop: a result line for each trial line (see EngineMember)."""
    for line in lines:
        job = json.loads(line)
        result = timed_generate(engine, job["prompts"], job["output_len"])
        out.write(json.dumps(result) + "\n")
        out.flush()


def engine_worker() -> None:
    from sluice import Engine

    engine = Engine(embedding_model_path="none")
    print("ready", flush=True)
    serve_trials(engine, sys.stdin, sys.stdout)
    engine.shutdown()


@dataclass(frozen=True)
class Config:
    label: str
    env: dict[str, str]
    flags: list[str]


def parse_config(spec: str) -> Config:
    """`label[:ENV=V,...[:flags]]` -> Config; raises ValueError naming what is wrong."""
    label, _, rest = spec.partition(":")
    env_part, _, flags = rest.partition(":")
    if not label:
        raise ValueError(f"--config {spec!r}: no label before the first ':'")
    env = {}
    for item in filter(None, (s.strip() for s in env_part.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--config {spec!r}: {item!r} is not ENV=VALUE")
        env[key] = value
    config = Config(label, env, shlex.split(flags))
    policy = env.get("OMP_WAIT_POLICY", "").upper()
    flags_text = " ".join(config.flags)
    if policy == "ACTIVE" or "--omp-wait-policy active" in flags_text:
        raise ValueError(
            f"--config {spec!r}: OpenMP's ACTIVE wait policy keeps an idle server's threads "
            "spinning, which slows the other servers' trials"
        )
    return config


def trial_ratios(results: dict[str, list[float]], base: str) -> dict[str, list[float]]:
    """Each configuration's trials divided by the base configuration's trial of the same round."""
    return {
        label: [x / b for x, b in zip(values, results[base], strict=True)]
        for label, values in results.items()
    }


def order_for_round(labels: list[str], round_index: int) -> list[str]:
    """The order the servers run in: as given in even rounds, reversed in odd ones."""
    return labels if round_index % 2 == 0 else labels[::-1]


def inverse_ratios(results: dict[str, list[float]], base: str, peer: str) -> list[float]:
    """base / peer, trial by trial (the pairs of `trial_ratios`, turned the other way)."""
    return [b / p for b, p in zip(results[base], results[peer], strict=True)]


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait


def wait_quiet(idle_share: float = QUIET_IDLE, window_s: float = 0.1, max_s: float = 5.0) -> float:
    """Wait until the machine is at least `idle_share` idle over a `window_s` window, at most
    `max_s`; returns the seconds waited. A server whose threads spin for a while after its
    trial (vLLM's OpenMP team does, for about a second) would otherwise slow the next trial:
    the order alternates, but with three servers the same one follows it every other round."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    start = time.monotonic()
    idle0, total0 = _cpu_times()
    while time.monotonic() - start < max_s:
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        if total1 > total0 and (idle1 - idle0) / (total1 - total0) >= idle_share:
            break
        idle0, total0 = idle1, total1
    return time.monotonic() - start


def _signal_member(member: ServerProcess | EngineMember, sig: int) -> None:
    """`sig` to a member's processes: a server's whole process group (its own session), the
    Engine worker's one process."""
    if member.proc is None or member.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # it ended since
        if isinstance(member, ServerProcess):
            os.killpg(member.proc.pid, sig)
        else:
            os.kill(member.proc.pid, sig)


@contextlib.contextmanager
def others_stopped(members: Iterable[ServerProcess | EngineMember]) -> Iterator[None]:
    """The other members stopped (SIGSTOP) while one runs its trial, continued (SIGCONT) after,
    on an error too. An idle server is not always idle: vLLM's CPU backend, between requests,
    still switches threads in about 1300 times a second (its 13 `gloo_tcp_loop` threads, each
    every 10 ms), and on 2 cores each of those takes a core from the member under trial."""
    stopped: list[ServerProcess | EngineMember] = []
    try:
        for member in members:
            stopped.append(member)  # first: a SIGCONT to one never stopped is harmless
            _signal_member(member, signal.SIGSTOP)
        yield
    finally:
        for member in stopped:
            _signal_member(member, signal.SIGCONT)


def run_trial(base_url: str, wl: Workload, prompts: list) -> tuple[float, float]:
    """(output tok/s, TTFT p99 in seconds) of one trial."""
    stats, errors, elapsed = run_loop(_drive(base_url, prompts, wl, len(prompts)))
    if errors:
        raise RuntimeError(f"{wl.name}: {len(errors)} requests failed, first: {errors[0]}")
    done = [s for s in stats if s is not None]
    return sum(s.output_tokens for s in done) / elapsed, percentile([s.ttft for s in done], 99)


def print_ttfts(ttfts: dict[str, list[float]], base: str, peers: list[str]) -> None:
    """The HTTP members' TTFT p99s: each over the base's by pairs (lower is better), and the
    base's over each peer's."""
    if base not in ttfts:
        return
    for label, values in ttfts.items():
        ratios = [v / b for v, b in zip(values, ttfts[base], strict=True)]
        print(
            f"{label:16s} TTFT p99 median {statistics.median(values):6.3f} s; / {base}: median "
            f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})",
            flush=True,
        )
    for peer in peers:
        if peer in ttfts:
            pairs = [b / p for b, p in zip(ttfts[base], ttfts[peer], strict=True)]
            print(
                f"{base} / {peer} TTFT p99: median {statistics.median(pairs):.3f} (min "
                f"{min(pairs):.3f}, max {max(pairs):.3f}) by pairs", flush=True,
            )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", action="append", default=[], help="label[:ENV=V,...[:flags]] (repeat)"
    )
    ap.add_argument(
        "--workloads", default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, of {', '.join(w for w in WORKLOADS if w != 'embeddings-short')}",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=12, help="trials per configuration and workload")
    ap.add_argument("--clients", type=int, default=DEFAULT_CLIENTS)
    ap.add_argument("--with-embedding-model", action="store_true")
    ap.add_argument(
        "--llama-server", action="store_true",
        help="llama.cpp's server as one more member of every round (built on first use)",
    )  # fmt: skip
    ap.add_argument(
        "--vllm", action="store_true",
        help="vLLM's CPU backend as one more member of every round (its venv made on first use)",
    )  # fmt: skip
    ap.add_argument(
        "--engine", action="store_true",
        help="this checkout's in-process Engine as one more member of every round",
    )  # fmt: skip
    ap.add_argument(
        "--keep-others-running", action="store_true",
        help="leave the other members running during a trial (by default they are stopped)",
    )  # fmt: skip
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.engine_worker:
        engine_worker()
        return
    if not args.config:
        ap.error("give at least one --config")
    try:
        configs = [parse_config(spec) for spec in args.config]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    chosen = ((LLAMA, args.llama_server), (VLLM, args.vllm), (ENGINE, args.engine))
    peers = [name for name, on in chosen if on]
    labels = [c.label for c in configs] + peers
    if len(set(labels)) != len(labels) or len(labels) < 2:
        raise SystemExit(
            f"give at least two --config, or one and a peer (--llama-server, --vllm), with "
            f"different labels (not {LLAMA!r} or {VLLM!r})"
        )
    workloads = select_workloads(args.workloads)
    if any(wl.kind != "completion" for wl in workloads):
        raise SystemExit("the embedding workload has no output tokens to compare")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from sluice.checkpoint.hf_dir import default_model_path, load_model_config
    from sluice.utils.system import available_cpus
    from sluice.utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(load_model_config(None).hf_dir)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds", flush=True)
    servers: dict[str, ServerProcess | EngineMember] = {}
    try:
        for c in configs:
            port = free_port()
            extra = c.flags if args.with_embedding_model else ["--no-embedding-model", *c.flags]
            env = {**os.environ, **c.env}
            print(f"{c.label}: sluice from {sluice_origin(env)}", flush=True)
            server = ServerProcess(
                c.label, sluice_command(port, extra), f"http://127.0.0.1:{port}",
                "/health_generate", env=env,
            )  # fmt: skip
            servers[c.label] = server.__enter__()
        if args.llama_server:
            from llama_server import ensure_binary

            port = free_port()
            most = max(wl.clients or args.clients for wl in workloads)  # its parallel slots
            cmd = llama_command(ensure_binary(), default_model_path(), port, most, available_cpus())
            server = ServerProcess(LLAMA, cmd, f"http://127.0.0.1:{port}", "/health")
            servers[LLAMA] = server.__enter__()
        if args.vllm:
            import vllm_server

            port = free_port()
            most = max(wl.clients or args.clients for wl in workloads)
            cmd = vllm_server.vllm_command(
                vllm_server.ensure_venv(), load_model_config(None).hf_dir, port, most
            )
            env = vllm_server.vllm_env()
            server = ServerProcess(VLLM, cmd, f"http://127.0.0.1:{port}", "/health", env=env)
            servers[VLLM] = server.__enter__()
        if args.engine:
            servers[ENGINE] = EngineMember().__enter__()
        for w, wl in enumerate(workloads):
            clients = wl.clients or args.clients
            warm = make_prompts(tokenizer, wl, 2, seed=args.seed + 1000 * w + 999)
            for server in servers.values():
                if isinstance(server, EngineMember):
                    server.trial(warm, WARMUP_OUTPUT)
                else:
                    run_loop(_drive(server.base_url, warm, WARMUP_OUTPUT, len(warm)))
            results: dict[str, list[float]] = {label: [] for label in labels}
            ttfts: dict[str, list[float]] = {
                label: [] for label in labels if not isinstance(servers[label], EngineMember)
            }
            for r in range(args.rounds):
                prompts = make_prompts(tokenizer, wl, clients, seed=args.seed + 1000 * w + r)
                for label in order_for_round(labels, r):
                    member = servers[label]
                    others = [] if args.keep_others_running else [
                        m for other, m in servers.items() if other != label
                    ]  # fmt: skip
                    with others_stopped(others):
                        wait_quiet()
                        if isinstance(member, EngineMember):
                            results[label].append(member.trial(prompts, wl.output_len))
                        else:
                            tok_s, ttft = run_trial(member.base_url, wl, prompts)
                            results[label].append(tok_s)
                            ttfts[label].append(ttft)
            print(f"\n== {wl.name}: {wl.describe()}, {clients} clients a trial ==")
            for label, ratios in trial_ratios(results, labels[0]).items():
                values = results[label]
                print(
                    f"{label:16s} median {statistics.median(values):7.1f} out tok/s; / "
                    f"{labels[0]}: median {statistics.median(ratios):.3f} (min {min(ratios):.3f},"
                    f" max {max(ratios):.3f}); trials {[round(v) for v in values]}",
                    flush=True,
                )
            for peer in peers:
                pairs = inverse_ratios(results, labels[0], peer)
                print(
                    f"{labels[0]} / {peer}: median {statistics.median(pairs):.3f} (min "
                    f"{min(pairs):.3f}, max {max(pairs):.3f}) by pairs", flush=True,
                )  # fmt: skip
            print_ttfts(ttfts, labels[0], peers)
    finally:
        for server in servers.values():  # none is left stopped, whatever ended the rounds
            _signal_member(server, signal.SIGCONT)
        for server in servers.values():
            server.__exit__(None, None, None)
        print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)


if __name__ == "__main__":
    main()
