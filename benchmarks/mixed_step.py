"""What a mixed step costs against its parts: one forward of a prompt arriving beside 31
decoding requests, against the same prompt alone plus the same decode step alone, in-process.

An `Engine` (default model and dtype) decodes 31 requests; one more arrives, and the forward of
the step that admits it (a mixed step) is captured, with the prompt's part and the decoding part
split out of it as forwards of their own. The three are replayed interleaved, `--reps` times
each, on the same pool: each rewrites the same K/V into the same slots, so the state never
moves. Prints the CPU milliseconds (median; this thread's with one thread, the process's
otherwise) of each, mixed - (prompt + decode), and which attention backend took each batch.

Cases (`--cases`), by what of the arriving prompt the radix cache already holds:
  fresh   a new prompt of `--prompt-len` tokens (prefix 0);
  cached  the prompt of a finished request again, so one token is computed (a repeated prompt);
  tail    the same with its last 3 tokens new (a templated prompt that differs at its end).

    .venv/bin/python benchmarks/mixed_step.py [--threads 1] [--reps 10] [--prompt-len 100]
        [--cases fresh,cached,tail]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from sluice.engine import Engine, parse_sampling_params
from sluice.messages import TokenizedGenerateReqInput
from sluice.model.attention import pick_backend
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.layers import PagedAttention

NUM_DECODING = 31


def capture_mixed_step(engine: Engine, prompt: list[int], rid: str) -> tuple:
    """Admit `prompt` beside the running batch and return the arguments its step built its
    (mixed) ForwardBatch with."""
    calls = []
    build = ForwardBatch.build.__func__

    def recording(cls, *args, **kwargs):
        calls.append(args)
        return build(cls, *args, **kwargs)

    sch = engine.scheduler
    params = parse_sampling_params({"max_new_tokens": 1, "temperature": 0})
    ForwardBatch.build = classmethod(recording)
    try:
        sch.add_request(
            TokenizedGenerateReqInput(rid=rid, input_ids=prompt, sampling_params=params)
        )
        sch.step()
    finally:
        ForwardBatch.build = classmethod(build)
    (args,) = calls
    return args


def split(args: tuple) -> dict[str, ForwardBatch]:
    """The mixed batch, its prompt (first: the scheduler puts new requests first) and its
    decoding rows, each as a batch of its own over the same slots."""
    _, ids, prefix_lens, extend_lens, loc, r2t, rows, _, device = args[:9]
    n = extend_lens[0]
    return {
        "mixed": ForwardBatch.build(*args),
        "prompt": ForwardBatch.build(
            ForwardMode.EXTEND, ids[:n], prefix_lens[:1], extend_lens[:1], loc[:n], r2t,
            rows[:1], [n - 1], device,
        ),
        "decode": ForwardBatch.build(
            ForwardMode.DECODE, ids[n:], prefix_lens[1:], extend_lens[1:], loc[n:], r2t,
            rows[1:], list(range(len(rows) - 1)), device,
        ),
    }  # fmt: skip


def measure(engine: Engine, batches: dict[str, ForwardBatch], reps: int, clock) -> dict:
    runner = engine.scheduler.runner
    for fb in batches.values():
        runner.forward(fb)  # warm
    times: dict[str, list[float]] = {k: [] for k in batches}
    for _ in range(reps):
        for name, fb in batches.items():
            start = clock()
            runner.forward(fb)
            times[name].append(clock() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--cases", default="fresh,cached,tail")
    args = ap.parse_args()
    engine = Engine(num_threads=args.threads)
    clock = time.thread_time if args.threads == 1 else time.process_time
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    sch = engine.scheduler
    done = prompt(args.prompt_len)  # a finished request's prompt, in the radix cache
    engine.generate(input_ids=done, sampling_params={"max_new_tokens": 1})
    params = parse_sampling_params({"max_new_tokens": 400, "temperature": 0, "ignore_eos": True})
    for i in range(NUM_DECODING):
        ids = prompt(args.prompt_len + 3 * i)
        sch.add_request(
            TokenizedGenerateReqInput(rid=f"d{i}", input_ids=ids, sampling_params=params)
        )
    while sch.waiting or sch.chunked_req is not None:
        sch.step()
    for _ in range(16):  # some decoded tokens, so the rows' lengths are those of a decode step
        sch.step()
    assert len(sch.running) == NUM_DECODING, len(sch.running)
    attn = next(m for m in sch.runner.model.modules() if isinstance(m, PagedAttention))
    prompts = {
        "fresh": prompt(args.prompt_len),
        "cached": done,
        "tail": done[:-3] + prompt(3),
    }
    print(
        f"{NUM_DECODING} decoding + 1 arriving, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}"
    )
    for case in args.cases.split(","):
        batches = split(capture_mixed_step(engine, prompts[case], f"new-{case}"))
        ms = measure(engine, batches, args.reps, clock)
        backends = {k: pick_backend(attn.backends, fb).name for k, fb in batches.items()}
        extra = ms["mixed"] - ms["prompt"] - ms["decode"]
        print(
            f"  {case:6s} prompt computes {batches['prompt'].input_ids.numel():3d} tokens: "
            + "  ".join(f"{k} {v:6.1f} ms ({backends[k]})" for k, v in ms.items())
            + f"  mixed - (prompt + decode) {extra:+6.1f} ms"
        )
    print(f"  load after: {os.getloadavg()[0]:.2f} (CPU ms, medians of {args.reps})")
    engine.shutdown()


if __name__ == "__main__":
    main()
