"""Decode step cost, fused decoder layers against the per-op path, in one process (one Engine).

The default model (SmolLM2-135M Q4_1 GGUF) in `--dtype` (bfloat16 by default), `--threads`
threads: for each round, each batch size and each path in turn (the order alternates between
rounds, so that drift on a shared machine falls on both), `--output-len` greedy tokens per
request, EOS ignored, the prefill's time removed by a 1-token run of the same prompts. Printed
per decode token: wall ms and tok/s, the process's CPU ms (every thread, OpenMP's included)
and the main thread's CPU ms; then the medians and the fused/per-op ratios. `--breakdown` adds,
per decode step, where the main thread's time goes: the decoder layers, the LM head, the rest of
the forward, and the scheduler's own work outside the forward (batch building, sampling, output). A batch
larger than the fused decode takes on this machine (`FusedDecode.max_rows`: 64 where a float
copy without an AMX copy computes larger batches, as in float32) runs the per-op path alone.

    .venv/bin/python benchmarks/decode_step.py [--rounds 5] [--output-len 256] \
        [--batch-sizes 1,4,8] [--dtype bfloat16] [--threads 2] [--breakdown]

The load average is printed with every round: figures taken beside other work are noise.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections import defaultdict
from statistics import median

PROMPT = "The river ran quietly beneath the old stone bridge, carrying leaves to the harbor"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float]:
    """(wall s, process CPU s, main thread CPU s) of generating `new_tokens` for each prompt."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    engine.scheduler.flush_cache()
    wall, cpu, thread = time.perf_counter(), cpu_s(), time.thread_time()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in outs)
    return time.perf_counter() - wall, cpu_s() - cpu, time.thread_time() - thread


def per_token(engine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Per decode token (of all requests): wall, process CPU and main thread CPU, in ms."""
    prefill = run(engine, prompts, 1)
    total = run(engine, prompts, output_len)
    tokens = len(prompts) * (output_len - 1)
    wall, cpu, thread = (1e3 * (t - p) / tokens for t, p in zip(total, prefill, strict=True))
    return {"wall_ms": wall, "tok_s": 1e3 / wall, "cpu_ms": cpu, "thread_ms": thread}


class Breakdown:
    """Main-thread CPU time per decode step in the layers, the LM head, the rest of the
    forward and outside it, by wrapping the runner's and the model's calls (this process only)."""

    def __init__(self, engine) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.decoding = False
        runner = engine.scheduler.runner
        model = runner.model
        self._wrap(runner, "forward", "forward")
        self._wrap(model.model, "forward", "layers")
        self._wrap(model.lm_head, "forward", "lm_head")

    def _wrap(self, obj, name: str, key: str) -> None:
        """Time obj.name while the runner's current forward is a decode step."""
        from sluice.model.forward_batch import ForwardMode

        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if key == "forward":
                self.decoding = args[0].mode == ForwardMode.DECODE
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.decoding:
                    self.times[key] += time.thread_time() - start
                    self.steps += key == "forward"

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.times.clear()
        self.steps = 0

    def report(self, step_thread_ms: float) -> str:
        n = max(self.steps, 1)
        layers, head = self.times["layers"] / n * 1e3, self.times["lm_head"] / n * 1e3
        forward = self.times["forward"] / n * 1e3
        return (
            f"layers {layers:.2f}, lm_head {head:.2f}, rest of forward "
            f"{forward - layers - head:.2f}, outside the forward {step_thread_ms - forward:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()

    from sluice import Engine

    engine = Engine(
        num_threads=args.threads, max_total_tokens=32 * 1024, dtype=args.dtype,
        embedding_model_path="none",
    )  # fmt: skip
    fused = engine.scheduler.runner.fused_decode
    if fused is None:
        raise SystemExit("this model or machine takes no fused decode (see the log)")
    ids = engine.tokenizer.encode(PROMPT)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    breakdown = Breakdown(engine) if args.breakdown else None
    per_token(engine, [ids], 8)  # warm-up
    results: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        paths = ("fused", "per-op") if r % 2 == 0 else ("per-op", "fused")
        for b in sizes:
            for path in paths if b <= fused.max_rows else ("per-op",):
                fused.enabled = path == "fused"
                steps = fused.steps
                if breakdown:
                    breakdown.reset()
                m = per_token(engine, [ids] * b, args.output_len)
                assert (fused.steps > steps) == fused.enabled
                results[(path, b)].append(m)
                extra = f"; {breakdown.report(m['thread_ms'] * b)}" if breakdown else ""
                print(
                    f"round {r + 1} batch {b} {path:6s}: {m['tok_s']:6.1f} tok/s, per token "
                    f"wall {m['wall_ms']:.2f} ms, process CPU {m['cpu_ms']:.2f} ms, main thread "
                    f"CPU {m['thread_ms']:.2f} ms (load {os.getloadavg()[0]:.2f}){extra}",
                    flush=True,
                )
    print(f"medians of {args.rounds} rounds, {args.dtype}, {args.threads} threads:")
    for b in sizes:
        med = {p: {k: median(m[k] for m in results[(p, b)]) for k in results[(p, b)][0]}
               for p in ("fused", "per-op") if results[(p, b)]}  # fmt: skip
        o = med["per-op"]
        if "fused" not in med:
            print(
                f"  batch {b}: per-op {o['tok_s']:.1f} tok/s, process CPU/token "
                f"{o['cpu_ms']:.2f} ms (the fused decode takes up to {fused.max_rows} rows here)"
            )
            continue
        f = med["fused"]
        print(
            f"  batch {b}: fused {f['tok_s']:.1f} tok/s vs per-op {o['tok_s']:.1f} "
            f"({f['tok_s'] / o['tok_s']:.2f}x); process CPU/token {f['cpu_ms']:.2f} vs "
            f"{o['cpu_ms']:.2f} ms ({f['cpu_ms'] / o['cpu_ms']:.2f}x); main thread "
            f"{f['thread_ms']:.2f} vs {o['thread_ms']:.2f} ms"
        )
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    engine.shutdown()


if __name__ == "__main__":
    main()
