"""Reasoning through the real server: `--reasoning-parser` splits `<think>...</think>` into
`reasoning_content` (whole and streamed), and a grammar applies only after `</think>`.

The model is a tiny random-weight Llama whose SmolLM2 tokenizer gains two added special tokens,
`<think>` (49152) and `</think>` (49153). Its noise is steered with `logit_bias` at temperature 0;
what a reply should hold is checked against the raw text of the same prompt through
/v1/completions (which no parser touches). Three servers: deepseek-r1 and qwen3 on that model,
and deepseek-r1 on the plain tiny Llama (no `</think>` token). Each ends idle, nothing left.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.server.live_server import LiveServer, assert_no_state_left, running_server
from tests.tiny_models import add_special_tokens, make_tiny_llama

openai = pytest.importorskip("openai")

THINK, THINK_END = 49152, 49153
ASK = [{"role": "user", "content": "Think it over, then describe a pet as JSON."}]
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "kind"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
NO_THINK_END = {str(THINK_END): -100}
THINK_END_FIRST = {str(THINK_END): 100}  # `</think>` is the first token (and every one after)


@dataclass
class Served:
    live: LiveServer
    client: openai.OpenAI
    model: str
    model_dir: str


@pytest.fixture(scope="module")
def think_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    out = tmp_path_factory.mktemp("think_llama")
    path = make_tiny_llama(out, tokenizer_dir=smollm2_hf_dir, vocab_size=49152 + 8)
    ids = add_special_tokens(path, ["<think>", "</think>"])
    assert ids == {"<think>": THINK, "</think>": THINK_END}
    return path


def _serve(model_dir: str, parser: str, tmp: pytest.TempPathFactory) -> Iterator[Served]:
    args = ["--reasoning-parser", parser, "--max-total-tokens", "4096", "--dtype", "float32",
            "--log-level", "warning", "--no-embedding-model"]  # fmt: skip
    log = tmp.mktemp(f"reasoning-{parser}") / "server.log"
    with running_server(model_dir, args, log, num_threads=1) as live:
        client = openai.OpenAI(base_url=f"{live.base}/v1", api_key="none", max_retries=0)
        yield Served(live, client, client.models.list().data[0].id, model_dir)


@pytest.fixture(scope="module")
def r1(think_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(think_llama_dir, "deepseek-r1", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(think_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(think_llama_dir, "qwen3", tmp_path_factory)


@pytest.fixture(scope="module")
def r1_plain(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tiny_llama_dir, "deepseek-r1", tmp_path_factory)


def _chat(srv: Served, **kw: Any) -> Any:
    return srv.client.chat.completions.create(model=srv.model, messages=ASK, temperature=0, **kw)


def _raw_text(srv: Served, max_tokens: int, logit_bias: dict[str, int]) -> str:
    """The unparsed text that the chat request with these settings generates."""
    resp = srv.client.completions.create(
        model=srv.model,
        prompt=_chat_prompt(srv.model_dir),
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=logit_bias,
    )
    return resp.choices[0].text


@functools.cache
def _chat_prompt(model_dir: str) -> str:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)


def _reasoning(obj: Any) -> str | None:
    """A message's or delta's `reasoning_content` (an extra field to the openai SDK)."""
    return (obj.model_extra or {}).get("reasoning_content")


def _streamed(srv: Served, **kw: Any) -> tuple[str | None, str, str | None]:
    """(reasoning deltas joined, None when there were none; content joined; finish_reason),
    checking that every reasoning delta comes before the first content delta."""
    reasoning: list[str] = []
    content: list[str] = []
    reason = None
    for chunk in _chat(srv, stream=True, **kw):
        for choice in chunk.choices:
            piece = _reasoning(choice.delta)
            if piece is not None:
                assert not "".join(content), f"reasoning {piece!r} after content {content}"
                reasoning.append(piece)
            content.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return ("".join(reasoning) if reasoning else None), "".join(content), reason


def test_think_tokens_are_added_and_the_tokenizer_kept(
    think_llama_dir: str, smollm2_hf_dir: str
) -> None:
    before = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    after = AutoTokenizer.from_pretrained(think_llama_dir)
    assert after.get_added_vocab()["</think>"] == THINK_END
    for i, tok in before.added_tokens_decoder.items():  # <|im_start|> and co. are still special
        assert (after.added_tokens_decoder[i].content, after.added_tokens_decoder[i].special) == (
            tok.content, tok.special,
        )  # fmt: skip
    assert after.encode("<|im_start|><think>a</think>", add_special_tokens=False)[:2] == [1, THINK]
    assert after.chat_template and after.chat_template == before.chat_template


# ---- deepseek-r1: the output starts inside the reasoning ------------------------------------


def test_r1_reasoning_that_never_ends_is_all_the_text(r1: Served) -> None:
    raw = _raw_text(r1, 20, NO_THINK_END)
    resp = _chat(r1, max_tokens=20, logit_bias=NO_THINK_END)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 20
    assert raw and _reasoning(choice.message) == raw
    assert choice.message.content == ""  # a string, as OpenAI's schema allows
    assert _streamed(r1, max_tokens=20, logit_bias=NO_THINK_END) == (raw, "", "length")


@pytest.mark.parametrize(
    "extra",
    [
        # with a reasoning parser, special tokens stay in the text by default: the parser must
        # see a `</think>` that is one
        pytest.param({}, id="defaults"),
        pytest.param({"skip_special_tokens": False}, id="special-tokens-kept"),
    ],
)
def test_r1_grammar_applies_after_think_end(r1: Served, extra: dict[str, Any]) -> None:
    """`</think>` first ends the (empty) reasoning; the schema then holds although logit_bias
    keeps pushing `</think>`, which the grammar's mask forbids from there on."""
    kw = {"max_tokens": 80, "logit_bias": THINK_END_FIRST, "response_format": PET_FORMAT,
          "extra_body": extra}  # fmt: skip
    choice = _chat(r1, **kw).choices[0]
    assert (_reasoning(choice.message), choice.finish_reason) == ("", "stop"), choice.message
    jsonschema.validate(json.loads(choice.message.content), PET)
    reasoning, content, reason = _streamed(r1, **kw)
    assert (reasoning or "", content, reason) == ("", choice.message.content, "stop")


def test_zz_r1_nothing_left_behind(r1: Served) -> None:
    state = r1.live.wait_idle()
    assert_no_state_left(state)
    assert state["num_grammar_reqs"] == 0


# ---- qwen3: the output opens the reasoning; enable_thinking False turns it off ---------------


def test_qwen3_thinking_off_is_all_content(qwen3: Served) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = _raw_text(qwen3, 20, {})
    choice = _chat(qwen3, max_tokens=20, extra_body=off).choices[0]
    assert raw and choice.message.content == raw
    assert _reasoning(choice.message) is None
    assert _streamed(qwen3, max_tokens=20, extra_body=off) == (None, raw, "length")
    # no reasoning to wait for: the grammar applies from the first token
    choice = _chat(qwen3, max_tokens=80, response_format=PET_FORMAT, extra_body=off).choices[0]
    assert choice.finish_reason == "stop" and _reasoning(choice.message) is None
    jsonschema.validate(json.loads(choice.message.content), PET)


def test_qwen3_output_without_think_has_no_reasoning(qwen3: Served) -> None:
    bias = {str(THINK): -100, **NO_THINK_END}
    raw = _raw_text(qwen3, 20, bias)
    message = _chat(qwen3, max_tokens=20, logit_bias=bias).choices[0].message
    assert raw and (message.content, _reasoning(message)) == (raw, None)


def test_zz_qwen3_nothing_left_behind(qwen3: Served) -> None:
    assert_no_state_left(qwen3.live.wait_idle())


# ---- a tokenizer without a `</think>` token -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_needs_a_think_end_token(r1_plain: Served, stream: bool) -> None:
    assert "</think>" not in AutoTokenizer.from_pretrained(r1_plain.model_dir).get_added_vocab()
    with pytest.raises(openai.BadRequestError) as info:
        resp = _chat(r1_plain, max_tokens=8, response_format=PET_FORMAT, stream=stream)
        list(resp) if stream else None
    assert info.value.status_code == 400 and "</think>" in info.value.message


def test_without_grammar_the_plain_tokenizer_still_serves(r1_plain: Served) -> None:
    raw = _raw_text(r1_plain, 12, {})
    resp = _chat(r1_plain, max_tokens=12)
    assert (resp.choices[0].message.content, _reasoning(resp.choices[0].message)) == ("", raw)


def test_zz_plain_nothing_left_behind(r1_plain: Served) -> None:
    assert_no_state_left(r1_plain.live.wait_idle())
