"""sluice's CPU attention kernels against the PyTorch path they replace, on SmolLM2's shapes.

Runs `PagedAttention` (9 heads, 3 KV heads, head_dim 64) over a 30-layer KV pool both ways in
one process: with sluice's C++ kernels (`sluice.model.kernels.cpu_ops()`), and with PyTorch ops
(the slots gathered, then `scaled_dot_product_attention`), which is what runs where the kernels
cannot be built. Decode steps read slots interleaved the way decoding leaves them, at uneven
lengths; a prefill of several prompts runs the extend kernel. Prints ms per 30-layer step for
each and their ratio.

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.kernels import cpu_ops
from sluice.model.kv_cache import KVCache
from sluice.model.layers import PagedAttention

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
CPU = torch.device("cpu")


def decode_case(batch: int, context: int) -> tuple[ForwardBatch, int]:
    """A decode step of `batch` requests of up to `context` slots (request b has b % 8 fewer,
    so the PyTorch path masks padding as in real batches). Slots interleave the way one token
    per request per step allocates them: slot l of request b is 1 + l * batch + b (a lone
    request's slots are consecutive)."""
    slots = 1 + torch.arange(context)[None, :] * batch + torch.arange(batch)[:, None]
    lens = [context - b % 8 for b in range(batch)]
    fb = ForwardBatch.build(
        ForwardMode.DECODE, [0] * batch, [n - 1 for n in lens], [1] * batch,
        slots[torch.arange(batch), torch.tensor(lens) - 1], slots, list(range(batch)),
        list(range(batch)), CPU,
    )  # fmt: skip
    return fb, batch * context + 1


def prefill_case(prompts: int, length: int) -> tuple[ForwardBatch, int]:
    """A prefill of `prompts` fresh prompts of `length` tokens, side by side."""
    slots = 1 + torch.arange(prompts * length).view(prompts, length)
    tokens = prompts * length
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, [0] * tokens, [0] * prompts, [length] * prompts, slots.view(-1),
        slots, list(range(prompts)), [tokens - 1], CPU,
    )  # fmt: skip
    return fb, tokens + 1


def time_step(layers: list[PagedAttention], fb: ForwardBatch, kv: KVCache, dtype) -> float:
    """ms per step of all layers, the best of three timings of three steps."""
    tokens = fb.input_ids.numel()
    q = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)

    def step() -> None:
        for layer in layers:
            layer(q, k, v, fb, kv)

    step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(3):
            step()
        best = min(best, (time.perf_counter() - start) / 3)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32,bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("sluice's CPU kernels could not be built (see the log above)")
    cases = {
        "decode 64 x 120": decode_case(64, 120),
        "decode 64 x 215": decode_case(64, 215),
        "decode 1 x 2000": decode_case(1, 2000),
        "prefill 8 x 128": prefill_case(8, 128),
    }
    print(f"PagedAttention, {LAYERS} layers, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}; "
          f"{args.threads} threads; ms per step (best of 3)")  # fmt: skip
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        with torch.inference_mode():
            for case, (fb, slots) in cases.items():
                kv = KVCache(slots, LAYERS, KV_HEADS, HEAD_DIM, dtype, CPU)
                for t in kv.k + kv.v:
                    t.normal_()
                layers = [PagedAttention(i, HEADS, KV_HEADS, HEAD_DIM) for i in range(LAYERS)]
                for layer in layers:
                    layer.cpu_ops = ops
                kv.cpu_ops = ops  # the K/V writes, as the runner hands them out
                kernel = time_step(layers, fb, kv, dtype)
                for layer in layers:
                    layer.cpu_ops = None
                kv.cpu_ops = None
                pytorch = time_step(layers, fb, kv, dtype)
                print(
                    f"{name:>9} {case:<16} sluice kernels {kernel:7.1f} ms   "
                    f"PyTorch ops {pytorch:7.1f} ms   ratio {pytorch / kernel:5.2f}x"
                )


if __name__ == "__main__":
    main()
