"""The block-weight kernel (`quant_ops.quant_linear`) with bfloat16 x: the float path (old)
against the integer path (new: x rounded to int8 per block, VNNI dot products), on SmolLM2-135M's
shapes; and, where the build has it (AVX-512 VNNI: `interleaved_types`), the integer path on the
row-interleaved layout that the model's bfloat16 layers take (`QuantLinear.interleave`, "ilv").

For each shape (K in, N out) and row count M, the paths run in this process, interleaved, over
enough copies of the weight (random values in the type's blocks) that they do not fit in the
caches, as in decoding, where every layer's weight is read once per token. Prints the median
GB/s of weight bytes read of each (over `--reps` timings), new / old and ilv / new. A type the
build's integer path does not take (the K-quants, Q4_K and Q6_K, but on AVX-512 VNNI) has only
its float path timed. The K-quants run only on shapes whose K is a multiple of 256 (`--shapes llama1b`,
Llama-3.2-1B's, has them all; SmolLM2's only `down`).

    .venv/bin/python benchmarks/quant_kernels.py [--threads 2] [--reps 7] [--types Q4_1,Q8_0]
        [--rows 1,4] [--shapes smollm2|llama1b]

`--engine` instead measures single-stream decode through the in-process `sluice.Engine` (the
default model, --quantization gguf, dtype auto): one Engine made with SLUICE_QUANT_INT8_ACT=0
(old) and one with it 1 (new), then, `--reps` times in turn, one chat prompt decoded for 128
greedy tokens (EOS ignored) on each; decode tok/s leaves out the prefill (a 1-token run's time).

`--engine --pool` instead compares the kernels' two ways of splitting work over threads in one
Engine (default settings), switched between runs: at::parallel_for, OpenMP's fork-join (old),
and sluice's pool of parallel.h (new). `--hog N` runs N busy-looping processes alongside (a
machine whose cores are shared with other work); `--output-len` the tokens per run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

from sluice.model.kernels import quant_ops
from sluice.model.quant import BLOCK_TYPES

SHAPES = {  # (K, N, name)
    "smollm2": [
        (576, 960, "qkv"), (576, 576, "o"), (576, 3072, "gate_up"), (1536, 576, "down"),
        (576, 49152, "lm_head"),
    ],
    "llama1b": [
        (2048, 3072, "qkv"), (2048, 2048, "o"), (2048, 16384, "gate_up"), (8192, 2048, "down"),
    ],
}  # fmt: skip
TYPE_IDS = {name: qtype for qtype, (name, _, _) in BLOCK_TYPES.items()}
SCALE_AT = {8: (0,), 2: (0,), 3: (0, 2), 12: (0, 2), 14: (208,)}  # a block's fp16 scales
STREAM_BYTES = 64 << 20  # the copies of a weight one timing cycles through


def random_blocks(n: int, k: int, qtype: int, rng: np.random.Generator) -> torch.Tensor:
    """[n, k] weights of random blocks: random bytes with small fp16 scales (and minimums)."""
    _, block_bytes, block_values = BLOCK_TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_values, block_bytes), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        scales = rng.uniform(0.001, 0.01, size=(n, k // block_values)).astype(np.float16)
        raw[:, :, at : at + 2] = scales[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def time_path(ops, x, weights, qtype, int8: bool, min_s: float = 0.05) -> float:
    """Seconds per call, cycling through `weights`."""
    calls, start = 0, time.perf_counter()
    while True:
        for w in weights:
            ops.quant_linear(x, w, qtype, None, int8)
        calls += len(weights)
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / calls


def engine_decode(reps: int, threads: int, output_len: int = 128) -> None:
    import os

    from sluice import Engine

    engines = {}
    for name, flag in (("old", "0"), ("new", "1")):
        os.environ["SLUICE_QUANT_INT8_ACT"] = flag  # read as the layers are made
        engines[name] = Engine(
            quantization="gguf", num_threads=threads, embedding_model_path="none"
        )
    os.environ.pop("SLUICE_QUANT_INT8_ACT")
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    tokenizer = engines["new"].tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    one = {**params, "max_new_tokens": 1}
    print(f"single stream, {len(ids)} prompt tokens, {output_len} out; "
          f"dtype {engines['new'].resources.dtype}; medians of {reps}")  # fmt: skip
    tps: dict[str, list[float]] = {"old": [], "new": []}
    texts = {}
    for _ in range(reps):
        for name, engine in engines.items():
            engine.generate(input_ids=ids, sampling_params=one)  # warm, and the prefill's time
            t0 = time.perf_counter()
            engine.generate(input_ids=ids, sampling_params=one)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params=params)
            tps[name].append((output_len - 1) / (time.perf_counter() - t0 - prefill))
            texts[name] = out["output_ids"]
    old, new = statistics.median(tps["old"]), statistics.median(tps["new"])
    print(f"old (float path) {old:.1f} tok/s {[round(t, 1) for t in tps['old']]}")
    print(f"new (int8 path)  {new:.1f} tok/s {[round(t, 1) for t in tps['new']]}")
    agree = next(
        (i for i, (a, b) in enumerate(zip(texts["old"], texts["new"], strict=True)) if a != b), None
    )
    print(f"new/old {new / old:.2f}; greedy tokens the same for the first "
          f"{output_len if agree is None else agree} of {output_len}")  # fmt: skip
    for engine in engines.values():
        engine.shutdown()


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """`count` processes that each keep a core busy, for the block's duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _decode_tps(engine, ids: list[int], output_len: int) -> tuple[float, list[int]]:
    """Decode tok/s of one greedy run (its prefill's time, a 1-token run's, left out)."""
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    one = {**params, "max_new_tokens": 1}
    t0 = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params=one)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)
    return (output_len - 1) / (time.perf_counter() - t0 - prefill), out["output_ids"]


def pool_decode(reps: int, threads: int, output_len: int, num_hogs: int) -> None:
    import os

    from sluice import Engine
    from sluice.model.kernels import cpu_ops, pool_wanted

    engine = Engine(num_threads=threads, embedding_model_path="none")
    ops = cpu_ops()
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    print(f"single stream, {len(ids)} prompt tokens, {output_len} out, {threads} threads, "
          f"{num_hogs} hog(s); load {os.getloadavg()[0]:.2f}; medians of {reps}")  # fmt: skip
    tps: dict[str, list[float]] = {"old": [], "new": []}
    cpu_s: dict[str, list[float]] = {"old": [], "new": []}
    outs = {}
    with hogs(num_hogs):
        _decode_tps(engine, ids, 8)  # warm: the pool's threads, the caches
        for _ in range(reps):
            for name in ("old", "new"):  # interleaved: drift and load hit both alike
                ops._pool_enable(name == "new")
                c0 = time.process_time()
                tok_s, outs[name] = _decode_tps(engine, ids, output_len)
                tps[name].append(tok_s)
                cpu_s[name].append((time.process_time() - c0) / output_len * 1e3)
    ops._pool_enable(pool_wanted())  # back to the process's setting (off unless asked)
    for name, what in (("old", "at::parallel_for"), ("new", "sluice pool     ")):
        print(f"{name} ({what}) {statistics.median(tps[name]):6.1f} tok/s "
              f"{[round(t, 1) for t in tps[name]]}; process CPU "
              f"{statistics.median(cpu_s[name]):.2f} ms/token")  # fmt: skip
    ratio = statistics.median(tps["new"]) / statistics.median(tps["old"])
    same = outs["old"] == outs["new"]
    print(f"new/old {ratio:.2f}; greedy tokens identical: {same}; "
          f"load after {os.getloadavg()[0]:.2f}")  # fmt: skip
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--types", default="Q4_1,Q8_0")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--engine", action="store_true", help="single-stream decode instead")
    parser.add_argument("--pool", action="store_true", help="with --engine: old/new thread split")
    parser.add_argument("--hog", type=int, default=0, help="with --pool: busy processes beside")
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if args.engine and args.pool:
        return pool_decode(args.reps, args.threads, args.output_len, args.hog)
    if args.engine:
        return engine_decode(args.reps, args.threads)
    torch.set_num_threads(args.threads)
    ops = quant_ops()
    if ops is None:
        raise SystemExit("the quantized-weight kernels did not build")
    print(f"integer path: {ops.int8_isa}; threads {args.threads}; medians of {args.reps}")
    print(f"{'type':5} {'shape':>16} {'M':>2} {'old GB/s':>9} {'new GB/s':>9} {'new/old':>8} "
          f"{'ilv GB/s':>9} {'ilv/new':>8}")  # fmt: skip
    rng = np.random.default_rng(0)
    for type_name in args.types.split(","):
        qtype = TYPE_IDS[type_name]
        for k, n, name in SHAPES[args.shapes]:
            if k % BLOCK_TYPES[qtype][2]:
                continue  # not a width this type can hold
            w0 = random_blocks(n, k, qtype, rng)
            copies = max(1, -(-STREAM_BYTES // w0.numel()))
            weights = [w0] + [random_blocks(n, k, qtype, rng) for _ in range(copies - 1)]
            ilv_type = ops.interleaved_types.get(qtype)
            woven = [ops.interleave(w, qtype, k) for w in weights] if ilv_type else []
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                old, new, ilv = [], [], []
                for _ in range(args.reps):  # interleaved: drift hits all alike
                    old.append(time_path(ops, x, weights, qtype, False))
                    if qtype in ops.int8_types:
                        new.append(time_path(ops, x, weights, qtype, True))
                    if woven:
                        ilv.append(time_path(ops, x, woven, ilv_type, True))
                t_old, gbs = statistics.median(old), w0.numel() / 1e9
                line = f"{type_name:5} {name:>7} {k:4}x{n:<5} {m:2} {gbs / t_old:9.2f} "
                t_new = statistics.median(new) if new else None
                line += (
                    f"{gbs / t_new:9.2f} {t_old / t_new:8.2f} " if new else f"{'-':>9} {'-':>8} "
                )
                if ilv:
                    t_ilv = statistics.median(ilv)
                    line += f"{gbs / t_ilv:9.2f} {t_new / t_ilv:8.2f}"
                print(line + ("" if ilv else f"{'-':>9} {'-':>8}"))


if __name__ == "__main__":
    main()
