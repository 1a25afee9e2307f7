"""Request models and their conversion into GenerateReqInput."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from sluice.config import ServerArgs
from sluice.server.app import create_app
from sluice.server.logprobs import TokenText, chat_logprobs, legacy_logprobs
from sluice.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenSessionRequest,
)
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.serving_completions import OpenAIServingCompletion
from sluice.server.serving_embedding import EmbeddingRequest
from sluice.server.serving_rerank import RerankRequest
from sluice.server.serving_score import ScoreRequest
from sluice.tokenizer.generate_input import GenerateReqInput
from sluice.tokenizer.normalize import RequestError, normalize, parse_sampling_params

CHAT_PATH = "/v1/chat/completions"


def _chat(**kw):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_sampling_params_use_sglang_names_and_only_given_fields() -> None:
    req = _chat(
        temperature=0, top_p=0, top_k=5, min_p=0.1, seed=7, stop="x", presence_penalty=1,
        frequency_penalty=-1, repetition_penalty=1.1, logit_bias={"12": -100}, min_tokens=2,
        ignore_eos=True, skip_special_tokens=False, n=2, unknown_field="ignored",
    )  # fmt: skip
    assert req.sampling_params() == {
        "temperature": 0, "top_p": 0, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": ["x"],
        "presence_penalty": 1, "frequency_penalty": -1, "repetition_penalty": 1.1,
        "logit_bias": {12: -100}, "min_new_tokens": 2, "ignore_eos": True,
        "skip_special_tokens": False, "n": 2,
    }  # fmt: skip
    assert _chat().sampling_params() == {"n": 1}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"max_tokens": 9}, 9), ({"max_completion_tokens": 7}, 7),
     ({"max_tokens": 9, "max_completion_tokens": 7}, 7),
     ({"max_tokens": 5, "max_completion_tokens": 7}, 5), ({}, None)],
)  # fmt: skip
def test_max_tokens_synonyms_smaller_wins(fields: dict, expected: int | None) -> None:
    assert _chat(**fields).sampling_params().get("max_new_tokens") == expected


@pytest.mark.parametrize(
    "fields",
    [{"max_tokens": -1}, {"top_p": 1.5}, {"n": 0}, {"logit_bias": {"abc": 1}},
     {"top_logprobs": 3}, {"messages": []}, {"temperature": "hot"}],
)  # fmt: skip
def test_invalid_chat_fields_rejected(fields: dict) -> None:
    with pytest.raises(ValidationError):
        _chat(**fields)


def test_content_parts_are_joined_for_the_template() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "name": "bob",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})  # fmt: skip
    assert req.template_messages() == [{"role": "user", "name": "bob", "content": "a\nb"}]


@pytest.mark.parametrize(
    ("prompt", "kind"),
    [("x", str), (["x", "y"], str), ([1, 2], int), ([[1], [2, 3]], list)],
)
def test_completion_prompt_kinds(prompt: object, kind: type) -> None:
    req = CompletionRequest.model_validate({"prompt": prompt})
    assert req.prompt == prompt
    assert isinstance(req.prompt if isinstance(prompt, str) else req.prompt[0], kind)


@pytest.mark.parametrize("prompt", [[], [[]], None, 5])
def test_completion_bad_prompts(prompt: object) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": prompt})


def _serving(fake_tm, cls):
    app = create_app(fake_tm, ServerArgs())
    return cls(app.state.ctx)


def test_chat_convert(fake_tm) -> None:
    serving = _serving(fake_tm, OpenAIServingChat)
    req = _chat(logprobs=True, top_logprobs=2, stream=True, max_tokens=3)
    obj = asyncio.run(serving.convert(req))
    # the templated text is tokenized without adding special tokens a second time
    assert obj.text is None and obj.input_ids == fake_tm.tokenizer.encode("hi")
    assert obj.return_logprob and obj.top_logprobs_num == 2 and obj.stream
    assert obj.sampling_params["max_new_tokens"] == 3
    assert isinstance(obj.rid, str) and len(obj.rid) == 32


@pytest.mark.parametrize(
    ("fields", "start", "text", "ids"),
    [({"prompt": [[1, 2], [3]]}, -1, None, [[1, 2], [3]]),
     ({"prompt": "ab", "echo": True, "logprobs": 1}, 0, "ab", None),
     ({"prompt": ["a", "b"], "logprobs": 0}, -1, ["a", "b"], None)],
)  # fmt: skip
def test_completion_convert(fake_tm, fields: dict, start: int, text: object, ids: object) -> None:
    serving = _serving(fake_tm, OpenAIServingCompletion)
    obj = asyncio.run(serving.convert(CompletionRequest.model_validate(fields)))
    assert (obj.text, obj.input_ids, obj.logprob_start_len) == (text, ids, start)
    assert obj.return_logprob == ("logprobs" in fields)


def test_logprob_shapes(fake_tm) -> None:
    tt = TokenText(fake_tm.tokenizer)
    chat = chat_logprobs(tt, [(-0.5, 4), (float("-inf"), 13)], [[(-0.5, 4)], []])
    assert chat["refusal"] is None
    assert chat["content"][0] == {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"),
        "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")}]}  # fmt: skip
    assert chat["content"][1]["logprob"] == -9999.0
    assert chat["content"][1]["bytes"] == list("你".encode())
    legacy = legacy_logprobs(tt, [(None, 10), (-1.0, 11)], [None, [(-1.0, 11)]], 1, 3)
    assert legacy == {"tokens": ["a", "b"], "token_logprobs": [None, -1.0],
        "top_logprobs": [None, {"b": -1.0}], "text_offset": [3, 4]}  # fmt: skip
    assert legacy_logprobs(tt, [(-1.0, 11)], [[]], 0)["top_logprobs"] is None


def test_byte_level_bpe_token_bytes() -> None:
    class ByteLevel:
        def decode(self, ids, skip_special_tokens=True):
            return "\ufffd"

        def convert_ids_to_tokens(self, token_id):
            return "Ã¤"  # byte-level form of b"\xc3\xa4"

    assert TokenText(ByteLevel()).bytes(0) == "ä".encode()


# ---- integers bounded to what the wire to the scheduler carries --------------------------------

BEYOND_INT64 = 1180591620717411303424  # 2**70: msgpack cannot encode it
INT64_RANGE = "[-9223372036854775808, 9223372036854775807]"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("model", "fields", "param"),
    [
        (ChatCompletionRequest, {"seed": BEYOND_INT64}, "seed"),
        (ChatCompletionRequest, {"seed": -BEYOND_INT64}, "seed"),
        (ChatCompletionRequest, {"n": BEYOND_INT64}, "n"),
        (ChatCompletionRequest, {"max_tokens": 2**63}, "max_tokens"),
        (ChatCompletionRequest, {"max_completion_tokens": 2**64}, "max_completion_tokens"),
        (ChatCompletionRequest, {"min_tokens": BEYOND_INT64}, "min_tokens"),
        (ChatCompletionRequest, {"top_k": BEYOND_INT64}, "top_k"),
        (ChatCompletionRequest, {"top_k": -2}, "top_k"),
        (ChatCompletionRequest, {"stop_token_ids": [1, 2**64]}, "stop_token_ids.1"),
        (ChatCompletionRequest, {"logit_bias": {str(2**64): 1}}, "logit_bias"),
        (ChatCompletionRequest, {"logit_bias": {"²": 1}}, "logit_bias"),
        (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
        (CompletionRequest, {"logprobs": BEYOND_INT64}, "logprobs"),
        (GenerateRequest, {"top_logprobs_num": BEYOND_INT64}, "top_logprobs_num"),
        (GenerateRequest, {"logprob_start_len": -BEYOND_INT64}, "logprob_start_len"),
        (OpenSessionRequest, {"capacity_of_str_len": BEYOND_INT64}, "capacity_of_str_len"),
        (EmbeddingRequest, {"dimensions": BEYOND_INT64}, "dimensions"),
        (EmbeddingRequest, {"truncate_prompt_tokens": BEYOND_INT64}, "truncate_prompt_tokens"),
        (RerankRequest, {"top_n": BEYOND_INT64}, "top_n"),
        (ScoreRequest, {"label_token_ids": [BEYOND_INT64]}, "label_token_ids.0"),
    ],
)  # fmt: skip
def test_integer_fields_are_bounded(model: type, fields: dict, param: str) -> None:
    base = {
        ChatCompletionRequest: {"messages": MSG}, CompletionRequest: {"prompt": "x"},
        GenerateRequest: {"text": "x"}, OpenSessionRequest: {}, EmbeddingRequest: {"input": "x"},
        RerankRequest: {"query": "q", "documents": ["d"]},
        ScoreRequest: {"query": "q", "items": ["i"]},
    }[model]  # fmt: skip
    with pytest.raises(ValidationError) as info:
        model.model_validate({**base, **fields})
    err = info.value.errors()[0]
    assert ".".join(map(str, err["loc"])) == param
    assert "must be an integer" in err["msg"], err["msg"]


def test_seed_beyond_int64_is_a_400_naming_seed_and_its_range(client, fake_tm) -> None:
    resp = client.post(CHAT_PATH, json={"messages": MSG, "seed": BEYOND_INT64})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "seed" and err["type"] == "invalid_request_error"
    assert INT64_RANGE in err["message"] and str(BEYOND_INT64) in err["message"]
    assert not fake_tm.requests  # refused before anything was sent


def test_int64_seeds_and_their_samples_stay_on_the_wire() -> None:
    req = _chat(seed=2**63 - 1, n=3)
    assert req.sampling_params()["seed"] == 2**63 - 1
    items = normalize(GenerateReqInput(text="x", sampling_params=req.sampling_params()))
    assert [it.params.seed for it in items] == [2**63 - 1, -(2**63), -(2**63) + 1]


@pytest.mark.parametrize(
    ("params", "param"),
    [({"seed": BEYOND_INT64}, "seed"), ({"top_k": 2**64}, "top_k"),
     ({"max_new_tokens": 2**64}, "max_new_tokens"), ({"min_new_tokens": 2**64}, "min_new_tokens"),
     ({"stop_token_ids": [2**64]}, "stop_token_ids"), ({"n": 2**64}, "n"),
     ({"logit_bias": {str(2**64): 1}}, "logit_bias")],
)  # fmt: skip
def test_native_sampling_params_are_bounded(params: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_sampling_params(params)
    assert info.value.param == param and "must be an integer in [" in info.value.message


def test_completions_default_to_16_tokens_chat_to_the_context() -> None:
    assert (
        CompletionRequest.model_validate({"prompt": "x"}).sampling_params()["max_new_tokens"] == 16
    )
    explicit = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None})
    assert explicit.sampling_params()["max_new_tokens"] == 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": 3}).max_new_tokens() == 3
    assert "max_new_tokens" not in _chat().sampling_params()  # the TokenizerManager fills it


def test_completions_without_max_tokens_ask_for_16(client, fake_tm) -> None:
    assert client.post("/v1/completions", json={"prompt": "ab"}).status_code == 200
    assert fake_tm.requests[-1].sampling_params["max_new_tokens"] == 16
