"""The model, the paged KV cache and the attention metadata against Hugging Face transformers.

Logits of tiny random-weight Llama and Qwen2 checkpoints must match transformers within 1e-4
(fp32) through a batched prefill of prompts of different lengths, a chunk on top of a cached
prefix, and batched decode of requests of different lengths. SmolLM2 (from the GGUF) must
generate the same greedy tokens as transformers, alone and in one batch. The tiny models run
twice: with sluice's C++ CPU kernels, and with the PyTorch ops they replace.

Where a CUDA device is present the same checks run on it too (float32, against transformers on
the CPU); elsewhere those variants are skipped. `scripts/device/` runs them on a lent GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.runner import ModelRunner
from sluice.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

ATOL = 1e-4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class Driver:
    """Drives a ModelRunner by hand: one request row per sequence, slots from an allocator."""

    def __init__(
        self, hf_dir: str, kernels: bool, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        cfg = ModelConfig.from_hf_dir(hf_dir)
        self.device = torch.device(device)
        self.runner = ModelRunner(cfg, self.device, dtype, kv_size=4096)
        with_ops = [m for m in self.runner.model.modules() if getattr(m, "cpu_ops", None)]
        assert with_ops or not kernels or device != "cpu", "the C++ CPU kernels did not build"
        for module in with_ops:
            module.cpu_ops = module.cpu_ops if kernels else None
        if not kernels:  # the K/V writes too: index_copy_
            self.runner.kv.cpu_ops = None
        # slot bookkeeping stays on the CPU, as in the scheduler; ForwardBatch moves what the
        # model reads to the device
        self.alloc = TokenToKVPoolAllocator(4096)
        self.pool = ReqToTokenPool(8, 512)
        self.lens: dict[int, int] = {}

    def new_seq(self) -> int:
        row = self.pool.alloc()
        self.lens[row] = 0
        return row

    def extend(self, chunks: dict[int, list[int]], all_logits: bool = True) -> list[torch.Tensor]:
        """Append `chunks[row]` to each sequence in one EXTEND forward; logits per chunk."""
        return self._forward(ForwardMode.EXTEND, chunks, all_logits)

    def decode(self, tokens: dict[int, int]) -> list[torch.Tensor]:
        return self._forward(ForwardMode.DECODE, {r: [t] for r, t in tokens.items()}, False)

    def _forward(self, mode, chunks: dict[int, list[int]], all_logits: bool) -> list[torch.Tensor]:
        rows = list(chunks)
        slots = self.alloc.alloc(sum(len(c) for c in chunks.values()))
        ids, rows_out, offset = [], [], 0
        for row in rows:
            n, start = len(chunks[row]), self.lens[row]
            self.pool.req_to_token[row, start : start + n] = slots[offset : offset + n]
            ids.extend(chunks[row])
            rows_out.append(list(range(offset, offset + n)) if all_logits else [offset + n - 1])
            offset += n
        fb = ForwardBatch.build(
            mode, ids, [self.lens[r] for r in rows], [len(chunks[r]) for r in rows], slots,
            self.pool.req_to_token, rows, [i for rs in rows_out for i in rs], self.device,
        )  # fmt: skip
        logits = self.runner.forward(fb).cpu()
        for row in rows:
            self.lens[row] += len(chunks[row])
        out, i = [], 0
        for rs in rows_out:
            out.append(logits[i : i + len(rs)])
            i += len(rs)
        return out


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_pair(request, tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(params=["kernels", "torch-ops", pytest.param("cuda", marks=CUDA)])
def pair(request, hf_pair):
    """(a Driver factory for the checkpoint, the transformers model of it on the CPU)."""
    path, hf = hf_pair
    device = "cuda" if request.param == "cuda" else "cpu"
    return (lambda: Driver(path, kernels=request.param == "kernels", device=device)), hf


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]


def test_batched_prefill_matches_transformers(pair):
    make_driver, hf = pair
    drv = make_driver()
    prompts = _prompts(0, [5, 17, 9, 1])
    rows = [drv.new_seq() for _ in prompts]
    got = drv.extend(dict(zip(rows, prompts, strict=True)))
    for ids, logits in zip(prompts, got, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_single_prompt_fast_path_matches(pair):
    make_driver, hf = pair
    drv = make_driver()
    (ids,) = _prompts(1, [23])
    (got,) = drv.extend({drv.new_seq(): ids})
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunk_on_cached_prefix_matches(pair):
    make_driver, hf = pair
    drv = make_driver()
    ids, other = _prompts(2, [30, 11])
    a, b = drv.new_seq(), drv.new_seq()
    drv.extend({a: ids[:12]})
    # the second chunk runs beside a fresh prompt: mixed prefix lengths in one batch
    got_a, got_b = drv.extend({a: ids[12:], b: other})
    torch.testing.assert_close(got_a, hf_logits(hf, ids)[12:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, hf_logits(hf, other), atol=ATOL, rtol=0)


def test_batched_decode_of_different_lengths_matches(pair):
    make_driver, hf = pair
    drv = make_driver()
    seqs = _prompts(3, [6, 13, 3])
    rows = [drv.new_seq() for _ in seqs]
    drv.extend(dict(zip(rows, seqs, strict=True)), all_logits=False)
    nxt = _prompts(4, [5, 5, 5])
    for step in range(5):
        got = drv.decode({r: n[step] for r, n in zip(rows, nxt, strict=True)})
        for i, seq in enumerate(seqs):
            seq.append(nxt[i][step])
            torch.testing.assert_close(got[i][0], hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


def assert_agree_in_bfloat16(reference: Driver, other: Driver, seed: int) -> None:
    """A prefill of prompts of different lengths, then a decode step, through both: the logits
    must agree within bfloat16's precision (2% of their largest magnitude)."""
    prompts = _prompts(seed, [9, 30, 4])
    outs = []
    for drv in (reference, other):
        rows = [drv.new_seq() for _ in prompts]
        got = drv.extend(dict(zip(rows, prompts, strict=True)))
        got += drv.decode({r: 7 for r in rows})
        outs.append(torch.cat(got).float())
    scale = outs[0].abs().max().item()
    torch.testing.assert_close(outs[1], outs[0], atol=0.02 * scale, rtol=0)


def test_bfloat16_kernels_agree_with_pytorch_ops(hf_pair):
    """In bfloat16 there is no transformers parity to hold to; the kernels and the PyTorch ops
    they replace must give the same logits within bfloat16's precision, prefill and decode."""
    path, _ = hf_pair
    ops, kernels = (Driver(path, kernels=k, dtype=torch.bfloat16) for k in (False, True))
    assert_agree_in_bfloat16(ops, kernels, seed=5)


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def smollm2_greedy_reference(smollm2_reference_dir):
    """transformers' greedy continuation (32 tokens) of each chat prompt, from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_reference_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_reference_dir, dtype=torch.float32)
    refs = []
    for text in PROMPTS:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tok.encode(chat, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
            )
        refs.append((ids, out[0, len(ids) :].tolist()))
    return refs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_smollm2_greedy_equals_transformers_alone_and_batched(smollm2_greedy_reference, device):
    from sluice import Engine

    engine = Engine(max_total_tokens=8192, check_invariants=True, device=device, dtype="float32")
    params = {"max_new_tokens": 32, "temperature": 0}
    for ids, ref in smollm2_greedy_reference:
        got = engine.generate(input_ids=ids, sampling_params=params)
        assert got["output_ids"] == ref
    batch = engine.generate(
        input_ids=[ids for ids, _ in smollm2_greedy_reference], sampling_params=params
    )
    assert [b["output_ids"] for b in batch] == [ref for _, ref in smollm2_greedy_reference]
    engine.scheduler.check_idle_invariant()
    engine.shutdown()
