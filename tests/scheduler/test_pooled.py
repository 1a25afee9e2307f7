"""Prefill-only pooled requests on the decoder scheduler: last-token embeddings and label-token
logprobs, checked against transformers; chunked prefill, prefix cache, batches mixed with
generation, invalid input, abort and timeouts, the Engine API and the process loop."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sluice.engine import Engine
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenizedEmbeddingReqInput,
    FinishReason,
    TokenizedEmbeddingReqInput,
)
from sluice.scheduler.timeouts import DeadlineTracker
from sluice.utils import ipc
from tests.scheduler.conftest import MakeEngine

VOCAB = 49152
LENGTHS = (3, 9, 17, 30)
TOL = 1e-4


@dataclass
class Pooled:
    vector: np.ndarray
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def req(rid: str, ids: list[int], labels: list[int] | None = None) -> TokenizedEmbeddingReqInput:
    return TokenizedEmbeddingReqInput(rid=rid, input_ids=ids, label_token_ids=labels, reply_to="w")


def drain(engine: Engine, max_steps: int = 1000) -> dict[str, Pooled]:
    """Step until idle; pooled results by rid (each reported once, never as tokens)."""
    sched, got = engine.scheduler, {}
    for _ in range(max_steps):
        if not sched.has_work():
            return got
        tokens = sched.step()
        out = sched.take_embedding_output()
        if out is None:
            continue
        assert tokens is None or not set(tokens.rids) & set(out.rids)
        assert len(out.cached_tokens) == len(out.rids) and set(out.reply_to) <= {"w"}
        for i, rid in enumerate(out.rids):
            assert rid not in got, f"{rid} reported twice"
            vec = np.frombuffer(out.embeddings[i], dtype="<f4")
            got[rid] = Pooled(
                vec, out.finished_reasons[i], out.prompt_tokens[i], out.cached_tokens[i]
            )
    raise AssertionError("scheduler still busy")


def run_pooled(engine: Engine, msgs: list[TokenizedEmbeddingReqInput]) -> dict[str, Pooled]:
    for m in msgs:
        engine.scheduler.add_embedding_request(m)
    return drain(engine)


# ---- transformers reference ---------------------------------------------------------------

_HF: dict[str, Any] = {}


def hf_last(model_dir: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2-normalized final-norm hidden state, full-vocabulary logprobs) at the last position."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _HF[model_dir]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        last = out.hidden_states[-1][0, -1]
        # hidden_states[-1] is after the final norm: the lm_head of it gives the logits
        assert torch.allclose(model.lm_head(last), out.logits[0, -1], atol=1e-5)
    return F.normalize(last, dim=-1), torch.log_softmax(out.logits[0, -1], dim=-1)


def max_diff(a: np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    return float(np.abs(a - (b.numpy() if isinstance(b, torch.Tensor) else b)).max())


@pytest.fixture(scope="module")
def qwen_engine(make_engine: MakeEngine, tiny_qwen2_dir: str) -> Engine:
    return make_engine(tiny_qwen2_dir, max_total_tokens=4096)


@pytest.fixture(scope="module")
def small_engine(make_engine: MakeEngine, tiny_llama_dir: str) -> Engine:
    """Chunks of 4 tokens and a KV pool smaller than the context (512)."""
    return make_engine(tiny_llama_dir, max_total_tokens=256, chunked_prefill_size=4)


@pytest.fixture(params=["llama", "qwen2"])
def model_case(request, tiny_engine, qwen_engine, tiny_llama_dir, tiny_qwen2_dir):
    if request.param == "llama":
        return tiny_engine, tiny_llama_dir
    return qwen_engine, tiny_qwen2_dir


# ---- results against transformers ----------------------------------------------------------


def test_embeddings_and_scores_of_one_batch_match_transformers(model_case) -> None:
    engine, model_dir = model_case
    engine.scheduler.flush_cache()
    labels = [[7, 3, 7], [100], [VOCAB - 1, 0]]
    msgs = [req(f"e{n}", rand_ids(n, n)) for n in LENGTHS]
    msgs += [req(f"s{i}", rand_ids(5 + 6 * i, 50 + i), lab) for i, lab in enumerate(labels)]
    steps = engine.scheduler.num_forward_steps
    got = run_pooled(engine, msgs)
    assert engine.scheduler.num_forward_steps == steps + 1  # one prefill for all seven
    for m in msgs:
        res = got[m.rid]
        assert res.reason == FinishReason(type="length") and res.prompt_tokens == len(m.input_ids)
        ref_vec, ref_lp = hf_last(model_dir, m.input_ids)
        if m.label_token_ids is None:
            assert res.vector.shape == (64,) and abs(np.linalg.norm(res.vector) - 1) < 1e-5
            assert max_diff(res.vector, ref_vec) < TOL
        else:
            assert max_diff(res.vector, ref_lp[m.label_token_ids]) < TOL


def test_chunked_prefill_and_prefix_cache_hit(small_engine: Engine, tiny_llama_dir: str) -> None:
    ids = rand_ids(30, 7)
    ref_vec, ref_lp = hf_last(tiny_llama_dir, ids)
    steps = small_engine.scheduler.num_forward_steps
    first = run_pooled(small_engine, [req("a", ids)])["a"]
    assert small_engine.scheduler.num_forward_steps - steps == 8  # 30 tokens in chunks of 4
    assert first.cached_tokens == 0 and max_diff(first.vector, ref_vec) < TOL
    again = run_pooled(small_engine, [req("b", ids), req("c", ids, [5, 6])])
    assert again["b"].cached_tokens == 29 and again["c"].cached_tokens == 29
    assert max_diff(again["b"].vector, first.vector) < 1e-5
    assert max_diff(again["c"].vector, ref_lp[[5, 6]]) < TOL


def test_engine_encode_shapes_and_cache(tiny_engine: Engine, tiny_llama_dir: str) -> None:
    text = "The quick brown fox"
    ids = tiny_engine.tokenizer.encode(text)
    one = tiny_engine.encode(text)
    assert isinstance(one, dict) and one["meta_info"]["prompt_tokens"] == len(ids)
    assert one["meta_info"]["finish_reason"] == {"type": "length"}
    ref, _ = hf_last(tiny_llama_dir, ids)
    assert max_diff(np.array(one["embedding"], dtype=np.float32), ref) < TOL
    by_ids = tiny_engine.encode(ids)  # a list of ints is one prompt, now a cache hit
    assert isinstance(by_ids, dict) and by_ids["meta_info"]["cached_tokens"] == len(ids) - 1
    assert np.allclose(by_ids["embedding"], one["embedding"], atol=1e-5)
    many = tiny_engine.encode([text, "hello", ids])
    assert isinstance(many, list) and [len(m["embedding"]) for m in many] == [64] * 3


def test_engine_score_semantics(tiny_engine: Engine, tiny_llama_dir: str) -> None:
    tok = tiny_engine.tokenizer
    query, items, labels = "Is the sky blue?", [" yes", " no way"], [100, 200, 300]
    for item_first in (False, True):
        texts = [it + query if item_first else query + it for it in items]
        ref = torch.stack([hf_last(tiny_llama_dir, tok.encode(t))[1][labels] for t in texts])
        probs = tiny_engine.score(query, items, labels, item_first=item_first)
        assert np.allclose(probs, ref.exp().numpy(), atol=1e-6, rtol=1e-4)
        soft = tiny_engine.score(query, items, labels, apply_softmax=True, item_first=item_first)
        assert np.allclose(soft, torch.softmax(ref, dim=-1).numpy(), atol=1e-5)
        assert np.allclose(np.sum(soft, axis=1), 1.0, atol=1e-5)
    q_ids, item_ids = [5, 6, 7], [[8, 9], [10]]
    ref = torch.stack([hf_last(tiny_llama_dir, q_ids + it)[1][labels] for it in item_ids])
    assert np.allclose(
        tiny_engine.score(q_ids, item_ids, labels), ref.exp().numpy(), atol=1e-6, rtol=1e-4
    )
    first = hf_last(tiny_llama_dir, [8, 9, 5, 6, 7])[1][labels].exp().numpy()
    assert np.allclose(tiny_engine.score(q_ids, item_ids, labels, item_first=True)[0], first)
    with pytest.raises(ValueError, match="label token ids must be in"):
        tiny_engine.score(q_ids, item_ids, [VOCAB])
    with pytest.raises(ValueError, match="all text or all token ids"):
        tiny_engine.score("q", [[1, 2]], labels)  # type: ignore[list-item]


# ---- pooled requests among generation requests ------------------------------------------------


def test_pooled_requests_mixed_with_generation(sharp_engine: Engine) -> None:
    """A pooled batch prefills while generation A decodes, and shares a prefill with B."""
    from sluice.engine import parse_sampling_params
    from sluice.messages import TokenizedGenerateReqInput

    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    a_ids, b_ids = rand_ids(12, 1), rand_ids(7, 2)
    alone = sharp_engine.generate(input_ids=[a_ids, b_ids], sampling_params=params)
    pooled_alone = run_pooled(
        sharp_engine, [req("p0", rand_ids(9, 3)), req("p1", rand_ids(7, 4), [4, 9])]
    )
    sharp_engine.scheduler.flush_cache()
    sched, tokens = sharp_engine.scheduler, {"A": [], "B": []}

    def gen(rid: str, ids: list[int]) -> TokenizedGenerateReqInput:
        return TokenizedGenerateReqInput(rid, ids, parse_sampling_params(params))

    def step() -> BatchEmbeddingOutput | None:
        out = sched.step()
        for i, rid in enumerate(out.rids if out is not None else []):
            tokens[rid].extend(out.new_token_ids[i])
        return sched.take_embedding_output()

    sched.add_request(gen("A", a_ids))
    assert step() is None and step() is None  # A prefilled, then decoding
    sched.add_request(gen("B", b_ids))
    sched.add_embedding_request(req("p0", rand_ids(9, 3)))
    sched.add_embedding_request(req("p1", rand_ids(7, 4), [4, 9]))
    assert len(sched.running) == 1
    emb = step()  # one prefill: B, p0, p1
    assert emb is not None and emb.rids == ["p0", "p1"] and len(sched.running) == 2
    while sched.has_work():
        assert step() is None
    assert tokens["A"] == alone[0]["output_ids"] and tokens["B"] == alone[1]["output_ids"]
    for i, rid in enumerate(emb.rids):
        vec = np.frombuffer(emb.embeddings[i], dtype="<f4")
        assert np.allclose(vec, pooled_alone[rid].vector, atol=1e-5)


def test_non_finite_vector_ends_only_its_request(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_engine.scheduler.runner
    real = runner.forward_output

    def poisoned(fb):
        out = real(fb)
        out.hidden = out.hidden.clone()
        out.hidden[0] = float("nan")
        return out

    monkeypatch.setattr(runner, "forward_output", poisoned)
    got = run_pooled(tiny_engine, [req("bad", rand_ids(4, 1)), req("ok", rand_ids(5, 2))])
    assert got["bad"].reason.status_code == 500 and got["bad"].vector.size == 0
    assert got["ok"].reason.type == "length" and got["ok"].vector.size == 64


# ---- invalid input, abort, timeouts ------------------------------------------------------------


def test_invalid_pooled_requests_get_400(small_engine: Engine) -> None:
    cases = {
        "empty": ([], None, "empty"),
        "oov": ([1, VOCAB], None, "token ids must be in"),
        "neg": ([-1, 5], None, "token ids must be in"),
        "oov_label": ([1, 2], [VOCAB], "label token ids"),
        "no_labels": ([1, 2], [], "label_token_ids is empty"),
        "too_long": (rand_ids(513, 1), None, "maximum context length is 512"),
        "pool": (rand_ids(300, 1), None, "KV pool holds 256"),
    }
    sched = small_engine.scheduler
    for rid, (ids, labels, _) in cases.items():
        sched.add_embedding_request(req(rid, ids, labels))
    sched.add_embedding_request(req("dup", [1, 2, 3]))
    sched.add_embedding_request(req("dup", [1, 2, 3]))
    assert sched.internal_state().num_waiting_reqs == 1
    out = sched.step()  # the rejected ones, and the first "dup" (one chunk)
    emb = sched.take_embedding_output()
    assert out is None and emb is not None and not sched.has_work()
    reasons = dict(zip(emb.rids, emb.finished_reasons, strict=True))
    for rid, (_, _, text) in cases.items():
        assert (reasons[rid].status_code, reasons[rid].code) == (400, "invalid_request")
        assert text in reasons[rid].message and reasons[rid].type == "abort"
    assert emb.embeddings[: len(cases)] == [b""] * len(cases)
    dups = [f for rid, f in zip(emb.rids, emb.finished_reasons, strict=True) if rid == "dup"]
    assert [f.status_code for f in dups] == [400, 0] and "already running" in dups[0].message
    assert dups[1].type == "length"  # the first "dup" was served


def test_abort_waiting_and_chunked_pooled_requests(small_engine: Engine) -> None:
    sched = small_engine.scheduler
    sched.add_embedding_request(req("long", rand_ids(40, 5)))
    sched.add_embedding_request(req("waiting", rand_ids(6, 6), [1]))
    sched.step()  # "long" prefills its first chunk
    assert sched.chunked_req is not None and sched.chunked_req.rid == "long"
    state = sched.internal_state()
    assert (state.num_running_reqs, state.num_waiting_reqs) == (1, 1)
    sched.abort(AbortReq(rid="waiting"))
    sched.abort(AbortReq(rid="long"))
    got = drain(small_engine)
    for rid in ("long", "waiting"):
        assert (got[rid].reason.status_code, got[rid].vector.size) == (499, 0)
    sched.add_embedding_request(req("x", [1, 2]))
    sched.add_embedding_request(req("y", [1, 2, 3], [4]))
    sched.abort(AbortReq(abort_all=True))
    assert {r.reason.status_code for r in drain(small_engine).values()} == {499}


def test_running_timeout_ends_a_pooled_request_with_503(
    small_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small_engine.scheduler, "deadlines", DeadlineTracker(0.0, 1e-9))
    got = run_pooled(small_engine, [req("slow", rand_ids(20, 9))])
    reason = got["slow"].reason
    assert (reason.status_code, reason.code, reason.matched) == (503, "timeout", "running_timeout")


# ---- the scheduler process loop ----------------------------------------------------------------


def test_process_loop_answers_pooled_messages(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.scheduler.loop import ModelLoop
    from sluice.scheduler.process import DecoderCore

    heartbeat = ipc.HeartbeatTimer(1e9)
    heartbeat.last = 1e18  # no beat during the test
    sent: list[Any] = []
    outbox = SimpleNamespace(send=sent.append)  # what the loop sends, in order
    loop = ModelLoop(DecoderCore(tiny_engine.scheduler, {}), None, outbox, heartbeat)
    batch = BatchTokenizedEmbeddingReqInput([req("m0", [5, 6, 7]), req("m1", [5, 6], [9])])
    inbox = [ipc.encode(batch), ipc.encode(req("m2", [])), b"\x81"]  # the last: truncated
    no_ids = {"type": "BatchTokenizedEmbeddingReqInput", "reqs": [{"rid": "m3", "reply_to": "w"}]}
    inbox.append(msgspec.msgpack.encode(no_ids))  # no input_ids
    monkeypatch.setattr(ipc, "recv_all", lambda sock, timeout: [inbox.pop(0)] if inbox else [])
    for _ in range(6):
        loop.run_once()
    assert all(isinstance(m, BatchEmbeddingOutput) for m in sent)
    reasons = {rid: f for m in sent for rid, f in zip(m.rids, m.finished_reasons, strict=True)}
    assert set(reasons) == {"m0", "m1", "m2", "m3"}
    assert reasons["m0"].type == reasons["m1"].type == "length"
    assert reasons["m2"].status_code == reasons["m3"].status_code == 400
    assert "malformed request" in reasons["m3"].message
    sizes = {rid: len(e) for m in sent for rid, e in zip(m.rids, m.embeddings, strict=True)}
    assert sizes == {"m0": 64 * 4, "m1": 4, "m2": 0, "m3": 0}
