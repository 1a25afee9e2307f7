"""Engine throughput: sluice.Engine vs transformers' batched generate, same weights, one run.

Workload (defaults): 64 prompts of about 100 tokens, 128 greedy output tokens each, EOS ignored.
Both run in this process on the SmolLM2-135M-Instruct weights dequantized from the GGUF, on the
same device (`--device`: CUDA when present, else the CPU, with the same thread count) and in the
same dtype (`--dtype`, auto by default: as the server resolves it). Prints output tokens per
second for each, their ratio, and the single-request decode speed of sluice.

    .venv/bin/python benchmarks/engine_throughput.py [--num-prompts 64] [--output-len 128] \
        [--dtype auto|float32|bfloat16] [--device cpu|cuda] [--quantization auto|gguf|none]

`--compare QUANT/DTYPE,...` (e.g. `gguf/float32,gguf/bfloat16,none/bfloat16,none/float32`)
instead loads one Engine per setting and measures them in turn, `--rounds` times, each round
in the same order: single-stream decode tok/s and the decode tok/s of a batch of
`--batch-size` requests; it prints each setting's median and its ratio to the first. Noisy
shared machines: alternating keeps drift out of the ratios.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

WORDS = (
    "the of and to in is was for on that with as by at from his her are were this which be or "
    "river mountain engine lantern quietly carefully number garden window story music silver "
    "across beneath during without history science market winter summer harbor island bridge"
).split()


def make_prompts(tokenizer, num: int, target_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        words = [rng.choice(WORDS) for _ in range(target_len)]
        ids = tokenizer.encode(" ".join(words))[:target_len]
        prompts.append(ids)
    return prompts


def bench_sluice(
    prompts: list[list[int]],
    output_len: int,
    threads: int,
    dtype: str,
    device: str,
    quantization: str = "auto",
) -> tuple[float, float, float]:
    from sluice import Engine

    engine = Engine(
        num_threads=threads, max_total_tokens=64 * 1024, dtype=dtype, device=device,
        quantization=quantization,
    )  # fmt: skip
    params = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    engine.generate(
        input_ids=prompts[:4], sampling_params={**params, "max_new_tokens": 4}
    )  # warm-up
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(o["meta_info"]["completion_tokens"] == output_len for o in outs)
    batch_tps = len(prompts) * output_len / elapsed
    # the prefill part of that: the same prompts with one output token, cache flushed first
    engine.scheduler.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})
    prefill_s = time.perf_counter() - start
    # single stream: decode speed of one request (prefill excluded by a 1-token run)
    one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts[0], sampling_params=one)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts[1], sampling_params=params)
    single_tps = (output_len - 1) / (time.perf_counter() - t0 - t_prefill)
    engine.shutdown()
    return batch_tps, single_tps, prefill_s


def decode_tps(engine, prompts: list[list[int]], output_len: int) -> float:
    """Decode tok/s of `prompts` run together: the time of `output_len` tokens each less that
    of a 1-token run of the same prompts (the prefill), cache flushed before each."""
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    engine.scheduler.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    prefill_s = time.perf_counter() - t0
    engine.scheduler.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": output_len})
    return len(prompts) * (output_len - 1) / (time.perf_counter() - t0 - prefill_s)


def compare(
    settings: list[str], prompts: list[list[int]], args: argparse.Namespace, threads: int
) -> None:
    """Each QUANT/DTYPE setting's single-stream and batched decode tok/s, in turn, rounds times."""
    from statistics import median

    from sluice import Engine

    engines = {}
    for setting in settings:
        quant, dtype = setting.split("/")
        engines[setting] = Engine(
            num_threads=threads, max_total_tokens=64 * 1024, dtype=dtype, device=args.device,
            quantization=quant, embedding_model_path="none",
        )  # fmt: skip
        decode_tps(engines[setting], prompts[:4], 4)  # warm-up
    batch = prompts[: args.batch_size]
    single: dict[str, list[float]] = {s: [] for s in settings}
    batched: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting, engine in engines.items():
            single[setting].append(decode_tps(engine, prompts[:1], args.output_len))
            batched[setting].append(decode_tps(engine, batch, args.output_len))
            print(f"round {r + 1} {setting:16s} single {single[setting][-1]:6.1f} tok/s, "
                  f"batch {len(batch)} {batched[setting][-1]:6.1f} tok/s", flush=True)  # fmt: skip
    first = settings[0]
    print(f"medians of {args.rounds} rounds (ratio to {first}):")
    for s in settings:
        one, many = median(single[s]), median(batched[s])
        print(f"  {s:16s} single {one:6.1f} tok/s ({one / median(single[first]):.2f}x)   "
              f"batch {len(batch)} {many:6.1f} tok/s ({many / median(batched[first]):.2f}x)")  # fmt: skip
    for engine in engines.values():
        engine.shutdown()


def bench_transformers(
    hf_dir: str, prompts: list[list[int]], output_len: int, dtype: str, device: str
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad
    )
    with torch.no_grad():
        model.generate(
            ids[:4], attention_mask=mask[:4], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == output_len
    return len(prompts) * output_len / elapsed


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    lines = dict(ln.split(":", 1) for ln in info.splitlines() if ":" in ln)
    fields = {k.strip(): v.strip() for k, v in lines.items()}
    return f"{fields.get('model name', '?')} (model {fields.get('model', '?')})"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="weights and activations, the same for both sides (auto: as `sluice serve` "
        "resolves it, bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else float32)",
    )  # fmt: skip
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
        help="where both sides run (default: cuda when present)",
    )  # fmt: skip
    ap.add_argument(
        "--quantization", choices=("auto", "gguf", "none"), default="auto",
        help="sluice's --quantization: gguf keeps the GGUF's blocks (transformers: dequantized)",
    )  # fmt: skip
    ap.add_argument("--compare", help="QUANT/DTYPE settings measured in turn (see above)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()

    from sluice.checkpoint.hf_dir import load_model_config
    from sluice.model.runner import resolve_dtype
    from sluice.utils.system import available_cpus

    args.dtype = str(resolve_dtype(args.dtype, torch.device(args.device))).removeprefix("torch.")
    from sluice.utils.tokenizer import get_tokenizer

    threads = available_cpus()
    torch.set_num_threads(threads)
    cfg = load_model_config(None)
    prompts = make_prompts(get_tokenizer(cfg.hf_dir), args.num_prompts, args.prompt_len)
    print(f"workload: {len(prompts)} prompts x ~{args.prompt_len} tokens, {args.output_len} greedy "
          f"output tokens each, EOS ignored; {threads} threads; model {cfg.model_name} {args.dtype} "
          f"on {args.device}")  # fmt: skip
    if args.compare:
        print(f"CPU: {cpu_model()}")
        compare(args.compare.split(","), prompts, args, threads)
        return
    sl_tps, single_tps, prefill_s = bench_sluice(
        prompts, args.output_len, threads, args.dtype, args.device, args.quantization
    )
    num_prompt = sum(len(p) for p in prompts)
    print(f"sluice.Engine:            {sl_tps:8.1f} output tok/s")
    print(
        f"  of which prefill:       {prefill_s:8.1f} s ({num_prompt / prefill_s:.0f} prompt tok/s)"
    )
    print(f"sluice single request:    {single_tps:8.1f} tok/s decode")
    if args.skip_transformers:
        return
    hf_tps = bench_transformers(cfg.hf_dir, prompts, args.output_len, args.dtype, args.device)
    print(f"transformers generate:    {hf_tps:8.1f} output tok/s (batch {len(prompts)})")
    print(f"ratio sluice/transformers: {sl_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
