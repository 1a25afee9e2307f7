"""The step seam without a scheduler or a model: a plan built from requests, executed on a fake
runner whose logits the test chooses, gives tokens, errors and vectors, and changes no request."""

from __future__ import annotations

import numpy as np
import torch

from sluice.messages import SamplingParams
from sluice.scheduler.batch import NON_FINITE, execute, plan_decode, plan_prefill
from sluice.scheduler.req import SCORE, Req

VOCAB = 16


class FakeRunner:
    """Returns the logits it is given, one row per logits row of the forward batch."""

    device = torch.device("cpu")
    cpu_ops = None  # the sampler's PyTorch ops

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self.calls = 0

    def forward(self, fb) -> torch.Tensor:
        self.calls += 1
        assert len(fb.logits_index) == self.logits.shape[0]
        return self.logits


def _req(rid: str, prompt: list[int], row: int, **params) -> Req:
    req = Req(rid, prompt, SamplingParams(temperature=0.0, **params), 0, frozenset())
    req.req_pool_idx = row
    return req


def test_decode_plan_executes_to_argmax_tokens_and_a_non_finite_error() -> None:
    reqs = [_req("a", [1, 2], 0, max_new_tokens=4), _req("b", [3], 1, max_new_tokens=4)]
    for req in reqs:
        req.output_ids = [5]
        req.kv_committed_len = req.seq_len - 1
    r2t = torch.zeros(2, 8, dtype=torch.int64)
    plan = plan_decode(reqs, r2t, torch.tensor([7, 8]), FakeRunner.device)
    assert r2t[0, 2] == 7 and r2t[1, 1] == 8  # the new slots are in the requests' rows
    logits = torch.zeros(2, VOCAB)
    logits[0, 9] = 5.0
    logits[1, 3] = float("nan")
    out = execute(FakeRunner(logits), plan)
    assert out.tokens == [9, None] and out.errors == [None, NON_FINITE]
    assert [r.kv_committed_len for r in reqs] == [2, 1]  # applying the output is the caller's


class KernelRunner(FakeRunner):
    """A fake runner with sluice's CPU kernels, whose logits are bfloat16 as a bfloat16
    model's: float32 only when `forward` is asked for them (its default)."""

    def __init__(self, logits: torch.Tensor) -> None:
        from sluice.model.kernels import cpu_ops

        super().__init__(logits.bfloat16())
        self.cpu_ops = cpu_ops()
        assert self.cpu_ops is not None, "the CPU kernels did not build (see the warning log)"
        self.float_logits: list[bool] = []

    def forward(self, fb, float_logits: bool = True) -> torch.Tensor:
        self.float_logits.append(float_logits)
        logits = super().forward(fb)
        return logits.float() if float_logits else logits


def test_a_greedy_step_without_logprobs_takes_the_argmax_of_the_models_own_logits() -> None:
    """Plain greedy rows that want no logprobs get their tokens from the bfloat16 logits as they
    come (no float32 copy), the same tokens as from the float32 ones, and a non-finite row its
    error; a row that wants logprobs, a penalty, or stop ids blocked below min_new_tokens takes
    the float32 path."""

    def decode(**params) -> tuple[list, torch.Tensor]:
        reqs = [_req(rid, [1, 2], row, max_new_tokens=4, **params) for row, rid in enumerate("abc")]
        for req in reqs:
            req.output_ids = [5]
            req.kv_committed_len = req.seq_len - 1
        r2t = torch.zeros(3, 8, dtype=torch.int64)
        return reqs, plan_decode(reqs, r2t, torch.tensor([7, 8, 9]), FakeRunner.device)

    logits = torch.randn(3, 70)
    logits[0, [11, 66]] = 9.0  # a tie: the first index
    logits[1, 3] = float("inf")
    logits[2, 69] = 9.0  # in the tail past the last whole vector
    _, plan = decode()
    runner = KernelRunner(logits)
    out = execute(runner, plan)
    assert runner.float_logits == [False]
    assert out.tokens == [11, None, 69] and out.errors == [None, NON_FINITE, None]
    float_path = execute(FakeRunner(runner.logits.float()), plan)  # the PyTorch sampler's
    assert float_path.tokens == out.tokens and float_path.errors == out.errors
    for params in ({"frequency_penalty": 0.5}, {"min_new_tokens": 2}):  # EOS blocked below 2
        runner = KernelRunner(logits)
        execute(runner, decode(**params)[1])
        assert runner.float_logits == [True], params
    reqs, plan = decode()
    reqs[2].return_logprob = True
    runner = KernelRunner(logits)
    out = execute(runner, plan)
    assert runner.float_logits == [True] and out.logprobs[2] is not None
    # a prefill whose greedy request is the only one to sample, beside a chunk that wants its
    # prompt's logprobs: those need the float32 logits too
    greedy = _req("g", [1, 2], 0, max_new_tokens=4)
    chunk = Req("c", [3, 4, 5, 6], SamplingParams(temperature=0.0), 0, frozenset(),
                return_logprob=True, logprob_start_len=0)  # fmt: skip
    chunk.req_pool_idx, chunk.is_chunked = 1, True
    greedy.extend_len, chunk.extend_len = 2, 2
    plan = plan_prefill([greedy, chunk], torch.zeros(2, 8, dtype=torch.int64),
                        torch.arange(1, 5), FakeRunner.device)  # fmt: skip
    assert plan.last == [greedy] and plan.spans
    runner = KernelRunner(torch.randn(3, 70))  # greedy's last row, the chunk's two
    out = execute(runner, plan)
    assert runner.float_logits == [True] and out.tokens[0] is not None
    assert [r.rid for r, _, _ in out.input_logprobs] == ["c"]


def test_prefill_plan_pools_a_score_request_and_leaves_prompt_only_unsampled() -> None:
    score = _req("s", [1, 2, 3], 0, max_new_tokens=0)
    score.pooled, score.label_token_ids = SCORE, [4, 6]
    prompt_only = _req("p", [5, 6], 1, max_new_tokens=0)
    reqs = [score, prompt_only]
    for req in reqs:
        req.extend_len = req.seq_len
    plan = plan_prefill(
        reqs, torch.zeros(2, 8, dtype=torch.int64), torch.arange(1, 6), FakeRunner.device
    )
    assert plan.last == reqs and plan.new_lens == [3, 2]
    logits = torch.randn(2, VOCAB)
    out = execute(FakeRunner(logits), plan)
    expected = torch.log_softmax(logits[0], dim=-1)[[4, 6]].numpy()
    assert np.allclose(np.frombuffer(out.pooled[0], dtype="<f4"), expected, atol=1e-6)
    assert out.tokens == [None, None] and out.errors == [None, None]
