"""Where a JSON schema's time goes, per scheduler step, in-process (no server, no HTTP).

The workloads of `structured_output.py`, driven through an `Engine`'s scheduler with C requests
in flight (closed loop: a finished request is replaced at once):

  A  unconstrained, 128 tokens, `ignore_eos`;
  B  a `json_schema` (8 schemas of the corpus round-robin), ending when the JSON closes;
  A' A's requests held (`ignore_eos`) to the lengths B's same requests had;
  Bseq B with the masks filled before the forward instead of beside it (`--only B,Bseq`);
  Beager B with every mask filled beside the forward: B's greedy rows fill one only when their
     grammar refuses their token (`--only B,Beager`).

For each it counts the steps by kind (prefill alone, mixed, decode), rows per step and prompt
tokens per prefill, and times (wall and process CPU, all threads) the forward, the sampler,
the mask filling and the grammar's advance with each accepted token. Process CPU time holds up
on a shared machine better than wall time; print `uptime` beside any figure. `--rounds` repeats
A, B and A' interleaved (the same process, the same warm caches) and reports each round.

    .venv/bin/python benchmarks/grammar_steps.py [--num-requests 64] [--concurrency 32]
        [--rounds 2] [--engine-args '{"key": value}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import sluice.scheduler.batch as batch_mod
import sluice.scheduler.scheduler as sched_mod
from sluice.engine import Engine, parse_sampling_params
from sluice.messages import TokenizedGenerateReqInput

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# the workloads are structured_output.py's: its schemas, prompts and output length
from structured_output import B_SCHEMAS, CORPUS, MAX_TOKENS, person_prompt  # noqa: E402


@dataclass
class Timer:
    """Wall and process-CPU seconds of one kind of work, and how many times it ran."""

    wall: float = 0.0
    cpu: float = 0.0
    calls: int = 0


@dataclass
class Stats:
    timers: dict[str, Timer] = field(default_factory=lambda: defaultdict(Timer))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0


STATS = Stats()


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        w, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            t = STATS.timers[name]
            t.wall += time.perf_counter() - w
            t.cpu += time.process_time() - c
            t.calls += 1

    return wrapper


def instrument(engine: Engine) -> None:
    """Wrap the pieces of a step with timers (this script only; the engine is its own)."""
    sch = engine.scheduler
    runner = sch.runner
    runner.forward = timed("forward", runner.forward)
    batch_mod.sample = timed("sample", batch_mod.sample)
    sched_mod.advance_grammar = timed("advance", sched_mod.advance_grammar)
    if sch.grammars is not None:
        sch.grammars.fill_masks = timed("fill_masks", sch.grammars.fill_masks)
    run_step = sch._run_step

    def counted(reqs, prefill, spared=None):
        kind = "decode" if not prefill else ("mixed" if spared else "prefill")
        STATS.steps[kind] += 1
        STATS.rows[kind] += len(reqs)
        if prefill:
            STATS.prompt_tokens += sum(r.extend_len for r in reqs) - len(spared or ())
        return timed(f"step:{kind}", run_step)(reqs, prefill, spared)

    sch._run_step = counted


def prompts(engine: Engine, n: int) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(n):
        chat = tok.apply_chat_template(
            [{"role": "user", "content": person_prompt(i)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


def drive(engine: Engine, work: list[tuple[list[int], dict]], concurrency: int) -> list[int]:
    """Run `work` with `concurrency` requests in flight; the output length of each."""
    global STATS
    STATS = Stats()
    sch = engine.scheduler
    lens = [0] * len(work)
    rid_of = {}
    next_i = 0
    live = 0
    w, c = time.perf_counter(), time.process_time()
    while next_i < len(work) or live:
        while live < concurrency and next_i < len(work):
            ids, params = work[next_i]
            rid = f"r{next_i}-{time.monotonic_ns()}"
            rid_of[rid] = next_i
            sch.add_request(
                TokenizedGenerateReqInput(
                    rid=rid, input_ids=ids, sampling_params=parse_sampling_params(params)
                )
            )
            next_i += 1
            live += 1
        out = sch.step()
        if out is None:
            continue
        for rid, new, reason in zip(out.rids, out.new_token_ids, out.finished_reasons, strict=True):
            lens[rid_of[rid]] += len(new)
            if reason is not None:
                live -= 1
                assert reason.type in ("stop", "length"), reason
    STATS.wall = time.perf_counter() - w
    STATS.cpu = time.process_time() - c
    STATS.output_tokens = sum(lens)
    return lens


def report(name: str, stats: Stats) -> None:
    steps = sum(stats.steps.values())
    print(
        f"  {name:3s} {stats.output_tokens:6d} tokens  {stats.output_tokens / stats.wall:7.1f} "
        f"tok/s wall  {stats.output_tokens / stats.cpu:7.1f} tok/cpu-s  steps {steps} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(stats.steps.items()))})  "
        f"prompt tokens {stats.prompt_tokens}"
    )
    rows = {k: stats.rows[k] / v for k, v in stats.steps.items()}
    print("      rows/step " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(rows.items())))
    for key, t in sorted(stats.timers.items()):
        print(
            f"      {key:14s} calls {t.calls:5d}  wall {1e3 * t.wall / max(t.calls, 1):7.2f} ms "
            f"cpu {1e3 * t.cpu / max(t.calls, 1):7.2f} ms/call  total cpu {t.cpu:6.2f} s "
            f"({100 * t.cpu / stats.cpu:4.1f}%)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engine-args", default="{}", help="Engine keyword arguments, as JSON")
    ap.add_argument(
        "--only",
        default="A,B,A'",
        help="workloads to run, comma-separated: A, B, A', Bseq (B, masks filled before the "
        "forward rather than beside it), Beager (B, every mask filled beside the forward)",
    )
    args = ap.parse_args()
    engine = Engine(**json.loads(args.engine_args))
    instrument(engine)
    corpus = {e["name"]: e for e in json.loads(CORPUS.read_text())["json_schemas"]}
    ids = prompts(engine, args.num_requests)
    schemas = [json.dumps(corpus[B_SCHEMAS[i % len(B_SCHEMAS)]]["schema"]) for i in range(len(ids))]
    plain = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    a = [(p, plain) for p in ids]
    b = [(p, {"max_new_tokens": MAX_TOKENS, "temperature": 0, "json_schema": s})
         for p, s in zip(ids, schemas, strict=True)]  # fmt: skip
    drive(engine, b[: len(B_SCHEMAS)] + a[:2], len(B_SCHEMAS) + 2)  # compile, warm up
    only = args.only.split(",")
    b_lens = drive(engine, b, args.concurrency)  # B's lengths, for A'
    matched = [(p, {**plain, "max_new_tokens": n}) for p, n in zip(ids, b_lens, strict=True)]
    work = {"A": a, "B": b, "Bseq": b, "Beager": b, "A'": matched}
    for r in range(args.rounds):
        print(f"round {r + 1}, load {os.getloadavg()[0]:.2f}")
        results = {}
        for name in only:
            engine.scheduler.grammars.overlap = name != "Bseq"
            engine.scheduler.grammars.check_first = name != "Beager"
            drive(engine, work[name], args.concurrency)
            results[name] = STATS
            report(name, STATS)
        tok_cpu = {k: v.output_tokens / v.cpu for k, v in results.items()}
        tok_wall = {k: v.output_tokens / v.wall for k, v in results.items()}
        for x, y in (("B", "A"), ("B", "A'"), ("A'", "A"), ("B", "Bseq"), ("B", "Beager")):
            if x in results and y in results:
                print(
                    f"  {x}/{y}: {tok_wall[x] / tok_wall[y]:.3f} wall, "
                    f"{tok_cpu[x] / tok_cpu[y]:.3f} per cpu-s"
                )
        print(f"  load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
