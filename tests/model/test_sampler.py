from __future__ import annotations

import math

import pytest
import torch

from sluice.messages import SamplingParams
from sluice.model import sampler
from sluice.model.sampler import (
    SamplingBatchInfo,
    apply_logit_processors,
    sample,
    step_uniform,
    token_logprobs,
)

V = 8
BASE_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def build(params, *, seeds=None, prompts=None, outputs=None, blocked=None, vocab=V):
    n = len(params)
    return SamplingBatchInfo.build(
        params,
        seeds if seeds is not None else list(range(n)),
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        blocked if blocked is not None else [[] for _ in range(n)],
        vocab,
    )


def reference_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The filtered distribution, written the slow obvious way in float64."""
    x = logits.double() / temperature
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    if top_k > 0:
        x[order[top_k:]] = float("-inf")
    p = torch.softmax(x, dim=0)
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i].item()
    q = torch.zeros_like(p)
    q[kept] = p[kept]
    q[q < min_p * q.max()] = 0.0
    return q / q.sum()


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.9, top_k=1)]
    info = build(params, vocab=50)
    assert info.is_all_greedy
    assert apply_logit_processors(logits, info) is logits  # nothing to process: no copy
    out = sample(logits, info, max_top_k=5)
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_logprobs is not None
    values, indices = out.top_logprobs
    assert values.shape == (6, 5) and indices.shape == (6, 5)
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    torch.testing.assert_close(values, raw.gather(1, indices))
    torch.testing.assert_close(values, raw.topk(5, dim=-1).values)


def test_logprobs_ignore_penalties_and_temperature():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 50.0}),
        SamplingParams(temperature=0.3, repetition_penalty=2.0),
    ]
    out = sample(logits, build(params, prompts=[[1], [2, 3]], vocab=30))
    assert out.next_token_ids[0].item() == 3  # the bias decided the token
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw[[0, 1], out.next_token_ids])


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(3)) * 3
    ids = torch.tensor([0, 39, 5, 5, 12, 1, 20])
    logprobs, top = token_logprobs(logits, ids, top_k=4)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logprobs, raw[torch.arange(7), ids])
    assert top is not None
    torch.testing.assert_close(top.values, raw.topk(4, dim=-1).values)
    assert torch.equal(top.indices, raw.topk(4, dim=-1).indices)
    assert token_logprobs(logits, ids)[1] is None


def test_repetition_penalty_is_hf_style_over_prompt_and_output():
    logits = BASE_LOGITS.repeat(2, 1)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    # token 1 (positive logit) in prompt, token 6 (negative) twice in output, 99 out of vocab
    info = build(params, prompts=[[1, 99], [1]], outputs=[[6, 6], [6]])
    got = apply_logit_processors(logits, info)
    want = BASE_LOGITS.clone()
    want[1] = 1.5 / 2.0
    want[6] = -1.0 * 2.0  # applied once however often the token appeared
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], BASE_LOGITS)  # row without the penalty untouched
    torch.testing.assert_close(logits, BASE_LOGITS.repeat(2, 1))  # input not modified


def test_frequency_presence_penalty_and_logit_bias_are_exact():
    logits = BASE_LOGITS.repeat(3, 1)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(logit_bias={2: 3.0, 7: -100.0}),
        SamplingParams(frequency_penalty=1.0, logit_bias={4: 2.0}),
    ]
    outputs = [[1, 1, 1, 4], [2], [4, 4]]
    info = build(params, prompts=[[0, 3], [0], [0]], outputs=outputs)
    got = apply_logit_processors(logits, info)
    want = BASE_LOGITS.repeat(3, 1)
    want[0, 1] -= 3 * 0.5 + 0.25
    want[0, 4] -= 1 * 0.5 + 0.25  # prompt tokens 0 and 3 are not penalised
    want[1, 2] += 3.0
    want[1, 7] += -100.0
    want[2, 4] += 2.0 - 2 * 1.0  # bias and penalty on the same token both apply
    torch.testing.assert_close(got, want)


def test_blocked_tokens_are_blocked_in_their_rows_only():
    """The caller (the batch) blocks the stop ids of rows below min_new_tokens; a row it
    passes no ids for (here the last, which reached min_new_tokens) is left as it is."""
    logits = BASE_LOGITS.repeat(3, 1)
    params = [SamplingParams(temperature=0.0, min_new_tokens=2)] * 3
    outputs = [[], [5], [5, 5]]
    info = build(params, outputs=outputs, blocked=[[0, 1], [0, 1], []])
    got = apply_logit_processors(logits, info)
    assert bool(torch.isinf(got[:2, :2]).all()) and bool((got[:2, :2] < 0).all())
    torch.testing.assert_close(got[2], BASE_LOGITS)
    assert sample(logits, info).next_token_ids.tolist() == [2, 2, 0]


def test_seeded_sampling_is_batch_invariant_over_steps():
    gen = torch.Generator().manual_seed(4)
    vocab = 300
    target = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.1, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, frequency_penalty=0.3, logit_bias={7: 2.0}),
    ]
    params = [others[i % 3] for i in range(3)] + [target] + [others[i % 3] for i in range(4)]
    alone_out: list[int] = []
    batch_outs: list[list[int]] = [[] for _ in range(8)]
    for _ in range(20):
        row = torch.randn(vocab, generator=gen) * 2
        batch_logits = torch.randn(8, vocab, generator=gen) * 2
        batch_logits[3] = row
        alone = SamplingBatchInfo.build([target], [1234], [[1, 2]], [alone_out], [[]], vocab)
        alone_out.append(sample(row.unsqueeze(0), alone).next_token_ids.item())
        seeds = [10 + i for i in range(8)]
        seeds[3] = 1234
        prompts = [[1, 2]] * 8
        info = SamplingBatchInfo.build(params, seeds, prompts, batch_outs, [[]] * 8, vocab)
        for i, t in enumerate(sample(batch_logits, info).next_token_ids.tolist()):
            batch_outs[i].append(t)
    assert batch_outs[3] == alone_out
    assert len(set(alone_out)) > 3  # it really sampled


def test_same_seed_same_token_different_seed_differs():
    logits = torch.zeros(4, 1000)  # uniform: every draw is a coin flip over 1000 tokens
    params = [SamplingParams(temperature=1.0)] * 4
    tokens = sample(logits, build(params, seeds=[7, 7, 8, 9], vocab=1000)).next_token_ids
    assert tokens[0] == tokens[1]
    assert len(set(tokens[1:].tolist())) == 3


def test_same_seed_draws_afresh_at_each_output_step():
    logits = torch.zeros(10, 1000)
    params = [SamplingParams(temperature=1.0)] * 10
    outputs = [[0] * step for step in range(10)]  # step t = len(output_ids)
    tokens = sample(logits, build(params, seeds=[7] * 10, outputs=outputs, vocab=1000))
    assert len(set(tokens.next_token_ids.tolist())) >= 8


def test_step_uniform_is_deterministic_and_spread():
    draws = [step_uniform(seed, step) for seed in range(50) for step in range(40)]
    assert all(0.0 < u < 1.0 for u in draws)
    assert step_uniform(3, 5) == step_uniform(3, 5) != step_uniform(3, 6)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02
    assert step_uniform(-1, 0) == step_uniform((1 << 64) - 1, 0)  # seeds taken mod 2**64


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1.5, top_k=3),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.9, min_p=0.2),
        dict(temperature=1.2, top_k=5, top_p=0.85, min_p=0.1),
    ],
)
def test_empirical_distribution_matches_filtered_distribution(kwargs):
    n = 6000
    params = [SamplingParams(**kwargs)] * n
    info = build(params, seeds=list(range(1000, 1000 + n)))
    tokens = sample(BASE_LOGITS.repeat(n, 1), info).next_token_ids
    counts = torch.bincount(tokens, minlength=V).double()
    expected = reference_probs(BASE_LOGITS, **kwargs)
    assert bool((counts[expected == 0] == 0).all()), "a filtered-out token was sampled"
    kept = expected > 0
    exp_counts = expected[kept] * n
    chi2 = float(((counts[kept] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(kept.sum()) - 1
    # mean dof, sd sqrt(2 dof): 6 sd above the mean fails only on a real bias
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)), (chi2, counts, exp_counts)


def test_mixed_batch_greedy_rows_take_argmax_of_processed_logits():
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0, logit_bias={10: 100.0}),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.7),
    ]
    out = sample(logits, build(params, vocab=60))
    ids = out.next_token_ids.tolist()
    assert ids[0] == 10 and ids[2] == logits[2].argmax().item()
    assert ids[1] in logits[1].topk(2).indices.tolist()
    assert out.next_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


@pytest.mark.parametrize("tiers", [(2,), (2, 50), (256, 2048)])
def test_top_p_cut_matches_full_sort(monkeypatch, tiers):
    # rows from flat to peaked, so some cuts lie beyond a tier of candidates
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", tiers)
    gen = torch.Generator().manual_seed(6)
    scales = torch.tensor([0.05, 0.5, 2.0, 8.0]).repeat(3).unsqueeze(1)
    probs = torch.softmax(torch.randn(12, 500, generator=gen) * scales, dim=-1)
    top_ps = torch.tensor([0.3, 0.9, 0.95, 0.5] * 3)
    cut = sampler._top_p_cut(probs, top_ps)
    for row in range(12):
        ref = reference_probs(probs[row].log(), top_p=top_ps[row].item())
        assert torch.equal(probs[row] >= cut[row], ref > 0), row


def test_top_p_and_min_p_cut_only_rows_that_use_them():
    probs = torch.softmax(torch.randn(3, 100, generator=torch.Generator().manual_seed(7)), -1)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
    ]
    info = build(params, vocab=100)
    assert info.top_p_rows is not None and info.top_p_rows.tolist() == [1]
    cut = sampler._prob_cut(probs, info)
    assert cut[0].item() == 0.0
    assert torch.equal(probs[1] >= cut[1], reference_probs(probs[1].log(), top_p=0.5) > 0)
    torch.testing.assert_close(cut[2], 0.3 * probs[2].max())


def test_grammar_bias_reads_bit_t_of_word_w_as_token_32w_plus_t():
    from sluice.model.sampler import grammar_bias

    gen = torch.Generator().manual_seed(0)
    vocab = 70  # three words, the last one partly past the vocabulary
    masks = torch.randint(-(2**31), 2**31 - 1, (4, 3), dtype=torch.int32, generator=gen)
    bias = grammar_bias(masks, vocab)
    for row in range(4):
        for token in range(vocab):
            allowed = (int(masks[row, token // 32]) >> (token % 32)) & 1
            assert bias[row, token] == (0.0 if allowed else float("-inf"))


@pytest.fixture(params=["torch", "cpu-kernels"])
def kernels(request):
    """How grammar masks are applied: PyTorch ops (None), or sluice's CPU kernels."""
    if request.param == "torch":
        return None
    from sluice.model.kernels import cpu_ops

    ops = cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning log)"
    return ops


def test_a_grammar_that_allows_only_a_blocked_stop_wins_over_min_new_tokens(kernels):
    """Row 0's grammar allows token 1 only, which min_new_tokens blocks: the grammar's mask
    alone applies to it; row 1 (no grammar) keeps the block."""
    logits = BASE_LOGITS.repeat(2, 1)
    params = [SamplingParams(temperature=0.0, min_new_tokens=3)] * 2
    only_token_1 = torch.zeros(1, (logits.shape[1] + 31) // 32, dtype=torch.int32)
    only_token_1[0, 0] = 1 << 1
    info = build(params, outputs=[[], []], blocked=[[1], [1]])
    info.grammar_rows, info.grammar_masks = torch.tensor([0]), only_token_1
    assert sample(logits, info, kernels=kernels).next_token_ids.tolist()[0] == 1
    assert sample(logits, info, kernels=kernels).next_token_ids.tolist()[1] != 1


@pytest.mark.parametrize("grammar_rows", [[0, 1, 2], [0, 2]])
def test_grammar_masks_leave_the_raw_logits_alone_on_every_path(grammar_rows, kernels):
    """Masks on every row (one add, no copy first) or on some: allowed tokens keep their
    logits, the others are -inf, unmasked rows are untouched, and the input is not modified."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 70, generator=gen)
    raw = logits.clone()
    masks = torch.randint(-(2**31), 2**31 - 1, (len(grammar_rows), 3), dtype=torch.int32)
    info = build([SamplingParams(temperature=0.0)] * 3, vocab=70)
    info.grammar_rows, info.grammar_masks = torch.tensor(grammar_rows), masks
    out = apply_logit_processors(logits, info, kernels)
    assert torch.equal(logits, raw)
    bias = sampler.grammar_bias(masks, 70)
    for row in range(3):
        want = raw[row] + bias[grammar_rows.index(row)] if row in grammar_rows else raw[row]
        assert torch.equal(out[row], want)
    got = sample(logits, info, kernels=kernels).next_token_ids  # the masked argmax, no copy
    assert got.tolist() == out.argmax(dim=-1).tolist()
    assert torch.equal(logits, raw)


@pytest.mark.parametrize("with_penalty", [False, True], ids=["grammar-only", "with-penalty"])
def test_grammar_rows_sample_the_same_tokens_with_or_without_the_kernels(with_penalty):
    """A batch of greedy and sampling rows, some constrained: the CPU kernels and the PyTorch
    ops pick the same tokens, every pick is allowed by its mask, and logprobs stay raw."""
    from sluice.model.kernels import cpu_ops

    gen = torch.Generator().manual_seed(3)
    vocab, n = 2100, 6  # past two argmax blocks, a last mask word partly past the vocabulary
    logits = torch.randn(n, vocab, generator=gen) * 3
    masks = torch.randint(-(2**31), 2**31 - 1, (4, 66), dtype=torch.int32, generator=gen)
    masks[1] = 0
    masks[1, 40] = 1 << 7  # one token allowed (1287)
    rows = [0, 2, 3, 5]
    params = [
        SamplingParams(temperature=t, repetition_penalty=1.3 if with_penalty and i == 2 else 1.0)
        for i, t in enumerate([0.0, 0.0, 0.0, 0.8, 0.0, 1.0])
    ]
    tokens = {}
    for name, ops in (("torch", None), ("cpu", cpu_ops())):
        info = build(params, outputs=[[5, 1287]] * n, vocab=vocab)
        info.grammar_rows, info.grammar_masks = torch.tensor(rows), masks
        out = sample(logits, info, kernels=ops)
        tokens[name] = out.next_token_ids.tolist()
        assert torch.equal(out.logprobs, token_logprobs(logits, out.next_token_ids)[0])
    assert tokens["torch"] == tokens["cpu"]
    assert tokens["cpu"][2] == 1287
    for g, row in enumerate(rows):
        token = tokens["cpu"][row]
        assert (int(masks[g, token // 32]) >> (token % 32)) & 1


@pytest.mark.parametrize("vocab", [1024 * 3, 1024 * 3 + 5, 1500, 700])
def test_greedy_argmax_is_torch_argmax_with_its_tie_break(vocab, kernels):
    """By blocks (`ARGMAX_BLOCK` 1024) or by the CPU kernel (`argmax_rows`), the same index as
    torch.argmax, the first on ties: within a block, across blocks, in a short last block, on
    rows of -inf with a few allowed tokens (a grammar's mask), and on non-contiguous views."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=g)
    x[1, [5, 600]] = 9.0  # a tie within the first block
    x[2, [vocab - 1, 1030 % vocab]] = 9.0  # a tie across blocks, one in the last
    x[3, vocab - 1] = 9.0  # the maximum alone in the last (maybe short) block
    x[4] = float("-inf")
    x[4, [vocab // 2, vocab - 2]] = 1.0  # only two allowed, tied
    x[5] = 0.0  # every token tied: index 0
    x[6, -3:] = 9.0  # a tie inside the last block
    x[7, :] = float("-inf")  # nothing allowed at all: index 0
    for logits in (x, x[:, :-1], x[::2], x.t().contiguous().t()):
        got = sampler.greedy_argmax(logits, kernels)
        assert got.dtype == torch.int64
        assert got.tolist() == logits.argmax(dim=-1).tolist()
