"""Grammar-constrained decoding in the scheduler (llguidance), on the tiny random-weight llama.

Unconstrained, that model emits noise, so an output that follows a schema, a regex or a Lark
grammar is there because the mask put it there. Every request here either finishes with "stop"
and validates, or ends with "length" (a string the noise never closes); enough of them stop for
the check to mean something.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from sluice.engine import Engine, parse_sampling_params
from sluice.messages import AbortReq, TokenizedGenerateReqInput
from sluice.scheduler.grammar import GrammarMatcher
from tests.scheduler.conftest import MakeEngine, RawDriver, RawResult
from tests.scheduler.test_retraction import set_new_token_ratio

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "grammar_corpus.json").read_text())
MAX_NEW = 256


@pytest.fixture(scope="module")
def engine(make_engine: MakeEngine, tiny_llama_dir: str) -> Engine:
    return make_engine(tiny_llama_dir, max_total_tokens=32768, max_running_requests=64)


def _prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.encode("Answer in the format asked for:")


def _generate(engine: Engine, grammars: list[dict[str, Any]], **params: Any) -> list[dict]:
    base = {"max_new_tokens": MAX_NEW, "temperature": 1.0, **params}
    prompts = [_prompt(engine)] * len(grammars)
    return engine.generate(
        input_ids=prompts,
        sampling_params=[{**base, "seed": i, **g} for i, g in enumerate(grammars)],
    )


def _finish(out: dict) -> str:
    return out["meta_info"]["finish_reason"]["type"]


def test_unconstrained_output_is_noise(engine: Engine) -> None:
    outs = _generate(engine, [{}] * 8, max_new_tokens=32)
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out["text"])


def test_every_schema_of_the_corpus_is_followed(engine: Engine) -> None:
    schemas = CORPUS["json_schemas"]
    assert len(schemas) >= 30
    outs = _generate(engine, [{"json_schema": json.dumps(s["schema"])} for s in schemas])
    num_stopped = 0
    for entry, out in zip(schemas, outs, strict=True):
        if _finish(out) == "length":
            continue
        assert _finish(out) == "stop", (entry["name"], out["meta_info"]["finish_reason"])
        jsonschema.validate(json.loads(out["text"]), entry["schema"])
        num_stopped += 1
    assert num_stopped >= len(schemas) // 2, f"only {num_stopped} of {len(schemas)} finished"


def test_every_regex_of_the_corpus_is_matched(engine: Engine) -> None:
    regexes = CORPUS["regexes"]
    outs = _generate(engine, [{"regex": r["regex"]} for r in regexes])
    stopped = [(r, o) for r, o in zip(regexes, outs, strict=True) if _finish(o) == "stop"]
    assert len(stopped) >= len(regexes) // 2
    for entry, out in stopped:
        assert re.fullmatch(entry["regex"], out["text"]), (entry["name"], out["text"])


def test_lark_grammars_of_the_corpus_end_in_their_language(engine: Engine) -> None:
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.model_config.vocab_size)
    grammars = CORPUS["lark"]
    outs = _generate(engine, [{"ebnf": g["grammar"]} for g in grammars])
    assert sum(_finish(o) == "stop" for o in outs) >= len(grammars) // 2
    for entry, out in zip(grammars, outs, strict=True):
        if _finish(out) != "stop":
            continue
        checker = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", entry["grammar"]))
        ids = out["output_ids"]
        if ids and ids[-1] == engine.tokenizer.eos_token_id:
            ids = ids[:-1]
        assert checker.consume_tokens(ids) and checker.is_accepting(), entry["name"]


def test_choice_terminates_with_stop_and_grammar_beats_min_tokens(engine: Engine) -> None:
    outs = _generate(engine, [{"regex": "(yes|no)"}] * 4, min_new_tokens=5)
    for out in outs:
        assert out["text"] in ("yes", "no")
        assert _finish(out) == "stop"


def test_greedy_and_seeded_constrained_outputs_do_not_depend_on_the_batch(engine: Engine) -> None:
    schema = {"json_schema": json.dumps(CORPUS["json_schemas"][0]["schema"])}
    mixed = [schema, {}, {"regex": "[a-z]{3,9}"}, schema, {}]
    alone = [
        engine.generate(
            input_ids=_prompt(engine), sampling_params={**p, "seed": 3, "max_new_tokens": 48}
        )
        for p in (schema, {"regex": "[a-z]{3,9}"})
    ]
    batch = engine.generate(
        input_ids=[_prompt(engine)] * len(mixed),
        sampling_params=[{**p, "seed": 3, "max_new_tokens": 48} for p in mixed],
    )
    assert batch[0]["output_ids"] == batch[3]["output_ids"] == alone[0]["output_ids"]
    assert batch[2]["output_ids"] == alone[1]["output_ids"]


def test_stop_strings_and_logprobs_with_a_grammar(engine: Engine) -> None:
    out = engine.generate(
        input_ids=_prompt(engine),
        sampling_params={"regex": "ab(c)+", "stop": ["cc"], "max_new_tokens": 32, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=3,
    )
    assert out["text"].startswith("ab") and _finish(out) == "stop"
    meta = out["meta_info"]
    # logprobs are of the raw logits, before the mask: the constrained pick need not be the
    # most likely token of the raw distribution
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(lps) == len(tops) == len(out["output_ids"])
    # each top list is [token_ids, logprobs] of the raw distribution
    below_top = [lp < top[1][0] for lp, top in zip(lps, tops, strict=True)]
    assert any(below_top), "the grammar should have overruled the raw argmax at least once"
    assert all(lp <= top[1][0] for lp, top in zip(lps, tops, strict=True))


def test_grammar_requests_survive_retraction(
    engine: Engine, make_engine: MakeEngine, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retracted and re-admitted, a constrained request goes on from where its grammar was:
    seeded, it ends with exactly the tokens it gets in a pool large enough for all."""
    small = make_engine(tiny_llama_dir, max_total_tokens=600, max_running_requests=16)
    set_new_token_ratio(small.scheduler, 0.05, monkeypatch)
    grammars = [{"regex": "[0-9]{100}"}] * 12  # a digit is a token: 100 tokens each
    outs = _generate(small, grammars, max_new_tokens=120)
    assert small.scheduler.num_retractions > 0
    expected = _generate(engine, grammars, max_new_tokens=120)
    for out, ref in zip(outs, expected, strict=True):
        assert out["output_ids"] == ref["output_ids"]
        assert re.fullmatch(grammars[0]["regex"], out["text"])


def test_bad_grammars_are_400_and_fail_fast_the_second_time(engine: Engine) -> None:
    bad = [
        {"json_schema": '{"type": "objectx"}'},
        {"regex": "(("},
        {"ebnf": "start: undefined_rule"},
    ]
    for _ in range(2):
        for out, grammar in zip(_generate(engine, bad, max_new_tokens=8), bad, strict=True):
            reason = out["meta_info"]["finish_reason"]
            assert reason["status_code"] == 400 and reason["code"] == "invalid_grammar", reason
            assert next(iter(grammar)) in reason["message"]


def test_conflicting_grammars_are_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="at most one of json_schema, regex and ebnf"):
        engine.generate("x", {"regex": "a", "ebnf": 'start: "a"'})
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        engine.generate("x", {"json_schema": "{not json"})
    with pytest.raises(ValueError, match="matches nothing"):
        engine.generate("x", {"json_schema": False})
    out = engine.generate("x", {"json_schema": "true", "max_new_tokens": 64, "temperature": 0})
    assert _finish(out) in ("stop", "length")  # a boolean schema true is taken: any JSON value
    if _finish(out) == "stop":
        json.loads(out["text"])


class BlockedPool:
    """Holds every thread of the grammar pool until released: compilations queue behind them
    (and do not start, so no compile timeout runs)."""

    def __init__(self, target: Engine | Any) -> None:
        """`target`: an Engine, or a scheduler's GrammarManager."""
        self.release = threading.Event()
        self.grammars = target.scheduler.grammars if isinstance(target, Engine) else target
        num = self.grammars.pool._max_workers
        started = threading.Barrier(num + 1)

        def hold() -> None:
            started.wait(10)
            self.release.wait(60)

        for _ in range(num):
            self.grammars.pool.submit(hold)
        started.wait(10)

    def __enter__(self) -> BlockedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()


def test_a_compiling_request_waits_apart_and_can_be_aborted(engine: Engine) -> None:
    driver = RawDriver(engine)
    sched = engine.scheduler
    schema = json.dumps({"type": "object", "properties": {"never_seen_before": {"type": "null"}}})
    with BlockedPool(engine):
        driver.add("compiling", _prompt(engine), json_schema=schema, max_new_tokens=8)
        driver.add("plain", _prompt(engine), max_new_tokens=4)
        for _ in range(10):
            driver.step()
        # the request without a grammar ran to its end past the one still compiling
        assert driver.results["plain"].finish is not None
        assert driver.results["compiling"].finish is None
        assert sched.internal_state().num_grammar_reqs == 1
        driver.abort("compiling")
        driver.step()
    assert driver.results["compiling"].finish.status_code == 499
    assert sched.internal_state().num_grammar_reqs == 0
    assert not sched.has_work()


def _slow_schema(num_options: int = 400) -> str:
    """A schema llguidance takes about a second to build (an anyOf of many wide objects)."""
    options = [
        {"type": "object", "required": [f"p{i}_0"],
         "properties": {f"p{i}_{j}": {"type": "string", "pattern": f"[a-z]{{{j + 1}}}x{i}"}
                        for j in range(30)}}
        for i in range(num_options)
    ]  # fmt: skip
    return json.dumps({"anyOf": options})


def test_compile_timeout_is_400_and_remembered(
    make_engine: MakeEngine, tiny_llama_dir: str
) -> None:
    """Only the grammar whose own compilation overran fails (and fails at once later); one
    that compiles quickly beside it, or behind it, is not hurt."""
    quick = make_engine(tiny_llama_dir, max_total_tokens=2048, grammar_compile_timeout=0.1)
    driver = RawDriver(quick)
    slow = _slow_schema()
    driver.add("slow", _prompt(quick), json_schema=slow, max_new_tokens=8)
    driver.add("quick", _prompt(quick), regex="(yes|no)", max_new_tokens=8)
    driver.run()
    reason = driver.results["slow"].finish
    assert reason.status_code == 400 and "took longer than 0.1 s" in reason.message
    assert driver.results["quick"].finish.type == "stop"
    driver.add("again", _prompt(quick), json_schema=slow, max_new_tokens=8)
    assert not quick.scheduler.grammars.queue  # failed at once, without compiling again
    driver.run()
    assert "took longer than" in driver.results["again"].finish.message


def test_an_abandoned_compilation_that_never_started_is_cancelled(engine: Engine) -> None:
    driver = RawDriver(engine)
    grammars = engine.scheduler.grammars
    regex = "(cancelled|before|start)"
    with BlockedPool(engine):
        driver.add("gone", _prompt(engine), regex=regex, max_new_tokens=4)
        driver.step()
        driver.abort("gone")
        driver.step()
        assert ("regex", regex) not in grammars.cache
    assert driver.results["gone"].finish.status_code == 499


def test_no_grammar_backend_refuses_grammars(make_engine: MakeEngine, tiny_llama_dir: str) -> None:
    plain = make_engine(tiny_llama_dir, max_total_tokens=2048, grammar_backend="none")
    out = plain.generate(
        input_ids=_prompt(plain), sampling_params={"regex": "a+", "max_new_tokens": 4}
    )
    reason = out["meta_info"]["finish_reason"]
    assert reason["status_code"] == 400 and "--grammar-backend none" in reason["message"]


def test_abort_all_reaches_compiling_requests(engine: Engine) -> None:
    driver = RawDriver(engine)
    with BlockedPool(engine):
        for i in range(3):
            driver.add(f"c{i}", _prompt(engine), regex=f"(held|{i})+", max_new_tokens=4)
        driver.step()
        engine.scheduler.abort(AbortReq(abort_all=True))
        driver.step()
    assert all(
        r.finish is not None and r.finish.status_code == 499 for r in driver.results.values()
    )


def test_grammar_starts_after_the_reasoning_ends(engine: Engine) -> None:
    """With `grammar_after_id`, tokens up to that one (the reasoning) are free and the grammar
    constrains what follows it. A strong bias makes the end token the first one sampled."""
    end = engine.tokenizer.encode("</think>")[-1]
    params = {"regex": "(yes|no)", "max_new_tokens": 12, "temperature": 1.0, "seed": 1,
              "logit_bias": {end: 100.0}}  # fmt: skip
    driver = RawDriver(engine)
    for rid in ("reasoning", "plain"):
        driver.results[rid] = RawResult()
        engine.scheduler.add_request(
            TokenizedGenerateReqInput(
                rid=rid, input_ids=_prompt(engine), sampling_params=parse_sampling_params(params),
                grammar_after_id=end if rid == "reasoning" else -1,
            )
        )  # fmt: skip
    driver.run()
    reasoning, plain = driver.results["reasoning"], driver.results["plain"]
    assert reasoning.output_ids[0] == end  # free before the end token: the bias won
    assert engine.tokenizer.decode(reasoning.output_ids[1:]) in ("yes", "no")
    assert reasoning.finish.type == "stop"
    assert end not in plain.output_ids  # the grammar held from the start: the bias lost
    assert engine.tokenizer.decode(plain.output_ids) in ("yes", "no")


def _reasoning_run(engine: Engine, bias: dict[int, float], after: int, start: int, **params):
    driver = RawDriver(engine)
    driver.results["r"] = RawResult()
    sampling = {"regex": "(yes|no)", "max_new_tokens": 12, "temperature": 1.0, "seed": 2,
                "logit_bias": bias, **params}  # fmt: skip
    engine.scheduler.add_request(
        TokenizedGenerateReqInput(
            rid="r", input_ids=_prompt(engine), sampling_params=parse_sampling_params(sampling),
            grammar_after_id=after, reasoning_start_id=start,
        )
    )  # fmt: skip
    driver.run()
    return driver.results["r"]


def test_optional_reasoning_opens_or_is_skipped_on_the_first_token(engine: Engine) -> None:
    tok = engine.tokenizer
    start, end = 1000, 2000  # any two tokens do as the reasoning's delimiters
    # the first token may open the reasoning (end is not allowed there: the mask holds the
    # grammar and the opening token), then it is free until the end token
    opened = _reasoning_run(engine, {start: 100.0, end: 101.0}, end, start)
    assert opened.output_ids[0] == start and end in opened.output_ids
    after = opened.output_ids[opened.output_ids.index(end) + 1 :]
    assert tok.decode(after) in ("yes", "no") and opened.finish.type == "stop"
    # anything else first: no reasoning, the grammar holds from the first token
    skipped = _reasoning_run(engine, {start: -100.0, end: 100.0}, end, start)
    assert tok.decode(skipped.output_ids) in ("yes", "no") and skipped.finish.type == "stop"


def test_stop_tokens_wait_for_the_end_of_the_reasoning(engine: Engine) -> None:
    """While a grammar waits for the reasoning to end, the request cannot stop: only the
    budget ends it (a 200 with unconstrained text and "stop" would be a lie)."""
    eos = engine.tokenizer.eos_token_id
    end = engine.tokenizer.encode("</think>")[-1]
    res = _reasoning_run(engine, {eos: 100.0, end: -100.0}, end, -1)
    assert eos not in res.output_ids and res.finish.type == "length"


def _person_schema() -> dict[str, str]:
    by_name = {e["name"]: e["schema"] for e in CORPUS["json_schemas"]}
    return {"json_schema": json.dumps(by_name["person"])}


def test_masks_are_filled_beside_the_forward_with_the_same_output(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `overlap`, every step's masks are being filled (on their thread) while its forward
    runs, and the seeded outputs are those of masks filled before the forward."""
    grammars, runner = engine.scheduler.grammars, engine.scheduler.runner
    grammars_in = [_person_schema(), {"regex": "[a-z]{3,40}"}] * 2
    monkeypatch.setattr(grammars, "overlap", False)
    before = _generate(engine, grammars_in, max_new_tokens=48)
    monkeypatch.setattr(grammars, "overlap", True)
    started = threading.Event()
    fill, forward = grammars.fill_masks, runner.forward
    beside: list[bool] = []

    def fill_masks(reqs: list[Any]) -> Any:
        started.set()
        return fill(reqs)

    def forward_(fb: Any, **kwargs: Any) -> Any:
        beside.append(started.wait(30))  # every step here has constrained rows
        started.clear()
        return forward(fb, **kwargs)

    monkeypatch.setattr(grammars, "fill_masks", fill_masks)
    monkeypatch.setattr(runner, "forward", forward_)
    beside_out = _generate(engine, grammars_in, max_new_tokens=48)
    assert len(beside) > 10 and all(beside)
    assert [o["output_ids"] for o in beside_out] == [o["output_ids"] for o in before]


def test_greedy_rows_check_their_token_before_any_mask_with_the_same_output(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain greedy row takes its raw argmax when its grammar allows it and gets a mask only
    when it does not (or when bytes are forced): over the whole corpus, tokens and logprobs are
    those of masks filled for every row."""
    grammars = engine.scheduler.grammars
    work = (
        [{"json_schema": json.dumps(s["schema"])} for s in CORPUS["json_schemas"]]
        + [{"regex": r["regex"]} for r in CORPUS["regexes"]]
        + [{"ebnf": g["grammar"]} for g in CORPUS["lark"]]
    )

    def run() -> list[dict]:
        return engine.generate(
            input_ids=[_prompt(engine)] * len(work),
            sampling_params=[{**g, "temperature": 0, "max_new_tokens": 64} for g in work],
            return_logprob=True,
        )

    monkeypatch.setattr(grammars, "check_first", False)
    masked = run()
    monkeypatch.setattr(grammars, "check_first", True)
    answers: list[bool] = []
    allows = GrammarMatcher.allows

    def counted(self: GrammarMatcher, token: int) -> bool:
        answers.append(allows(self, token))
        return answers[-1]

    monkeypatch.setattr(GrammarMatcher, "allows", counted)
    checked = run()
    # the noise model's argmax is often refused and often allowed: both paths ran
    assert answers.count(True) > 100 and answers.count(False) > 100, answers.count(True)
    for out, ref in zip(checked, masked, strict=True):
        assert out["output_ids"] == ref["output_ids"]
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
        lps = out["meta_info"]["output_token_logprobs"]
        assert lps == pytest.approx(ref["meta_info"]["output_token_logprobs"], abs=1e-5)


def test_forced_bytes_take_the_mask_with_its_canonical_tokens(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a grammar forces the next bytes, llguidance's mask allows only their canonical
    tokens, while the grammar would take any split of them: such a greedy row gets the mask.
    Here the raw argmax is always "h", a split of the forced "humidity" that the grammar
    allows and the mask does not."""
    grammars, runner = engine.scheduler.grammars, engine.scheduler.runner
    h = engine.tokenizer.convert_tokens_to_ids("h")
    matcher = grammars.compile(("regex", "humidity")).future.result().matcher
    state = GrammarMatcher(matcher.deep_copy())
    assert state.has_forced_bytes and state.allows(h)
    word, bit = divmod(h, 32)
    assert not (int(grammars.fill_masks([_Row(state)])[0, word]) >> bit) & 1

    forward = runner.forward

    def pushed(fb: Any, **kwargs: Any) -> Any:
        logits = forward(fb, **kwargs).clone()
        logits[:, h] += 100.0
        return logits

    monkeypatch.setattr(runner, "forward", pushed)
    outs = {}
    for check in (False, True):
        monkeypatch.setattr(grammars, "check_first", check)
        outs[check] = engine.generate(
            input_ids=_prompt(engine),
            sampling_params={"regex": "humidity", "temperature": 0, "max_new_tokens": 8},
        )
    assert outs[True]["text"] == "humidity" and outs[True]["output_ids"][0] != h
    assert outs[True]["output_ids"] == outs[False]["output_ids"]


class _Row:
    """What `fill_masks` reads of a request."""

    def __init__(self, grammar: GrammarMatcher) -> None:
        self.grammar, self.reasoning_start_id = grammar, -1


def test_a_failing_forward_waits_for_its_masks_before_its_requests_end(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matcher is never read (mask thread) and dropped or advanced (loop) at once: a forward
    that fails ends its requests only once their masks are filled."""
    grammars, sched = engine.scheduler.grammars, engine.scheduler
    monkeypatch.setattr(grammars, "overlap", True)
    events: list[str] = []
    release = threading.Event()
    fill, finish = grammars.fill_masks, sched.finish

    def fill_masks(reqs: list[Any]) -> Any:
        release.wait(30)  # held until the forward has failed
        masks = fill(reqs)
        events.append("masks")
        return masks

    def forward_(fb: Any, **kwargs: Any) -> Any:
        release.set()
        raise RuntimeError("injected fault")

    def finish_(req: Any, reason: Any) -> None:
        events.append("finish")
        finish(req, reason)

    monkeypatch.setattr(grammars, "fill_masks", fill_masks)
    monkeypatch.setattr(sched.runner, "forward", forward_)
    monkeypatch.setattr(sched, "finish", finish_)
    outs = _generate(engine, [_person_schema()] * 2, max_new_tokens=8)
    assert [o["meta_info"]["finish_reason"]["status_code"] for o in outs] == [500, 500]
    assert events[0] == "masks" and events.count("finish") == 2
