"""The app around a fake TokenizerManager: SSE bytes, error bodies and statuses, shapes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sluice.config import ServerArgs
from sluice.server.app import create_app
from sluice.tokenizer.normalize import RequestError
from tests.server.conftest import FakeRequestError

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _events(body: bytes) -> list[Any]:
    """The data payloads of an SSE body, in order (JSON decoded; "[DONE]" kept as a string)."""
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n")
    out = []
    for frame in text.split("\n\n")[:-1]:
        if frame.startswith(":"):
            continue
        assert frame.startswith("data: ")
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _stream(client, path: str, body: dict) -> tuple[Any, bytes]:
    with client.stream("POST", path, json=body) as resp:
        return resp, resp.read()


def _assert_error(resp, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    if code is not None:
        assert err["code"] == code
    return err


def test_chat_stream_bytes_exact(client) -> None:
    body = {"messages": MSG, "stream": True, "max_tokens": 2, "model": "fake-model"}
    resp, raw = _stream(client, CHAT, body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    first = json.loads(raw.decode().split("\n\n")[0][6:])
    cid, created = first["id"], first["created"]
    head = f'"id":"{cid}","object":"chat.completion.chunk","created":{created},"model":"fake-model"'
    expected = (
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
        f'"logprobs":null,"finish_reason":null}}]}}\n\n'
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"content":"Hel"}},"logprobs":null,'
        f'"finish_reason":null}}]}}\n\n'
        f'data: {{{head},"choices":[{{"index":0,"delta":{{"content":"lo"}},"logprobs":null,'
        f'"finish_reason":null}}]}}\n\n'
        f'data: {{{head},"choices":[{{"index":0,"delta":{{}},"logprobs":null,'
        f'"finish_reason":"length","matched_stop":null}}]}}\n\n'
        "data: [DONE]\n\n"
    )
    assert raw.decode() == expected
    assert cid.startswith("chatcmpl-")


def test_chat_stream_usage_last_and_null_elsewhere(client) -> None:
    body = {"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
    _, raw = _stream(client, CHAT, body)
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Hello wörld!"


def test_chat_stream_n3_role_first_and_one_finish_per_choice(client) -> None:
    _, raw = _stream(client, CHAT, {"messages": MSG, "stream": True, "n": 3})
    chunks = [e for e in _events(raw) if e != "[DONE]"]
    assert all("usage" not in c for c in chunks)
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert [c["finish_reason"] for c in mine].count("stop") == 1
        assert mine[-1]["finish_reason"] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["delta"].get("content", "") for c in mine) == "Hello wörld!"


def test_chat_non_stream_n3_and_usage(client) -> None:
    resp = client.post(CHAT, json={"messages": MSG, "n": 3, "max_completion_tokens": 3})
    assert resp.status_code == 200
    data = resp.json()
    assert data["object"] == "chat.completion" and data["model"] == "fake-model"
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for c in data["choices"]:
        assert c["message"] == {"role": "assistant", "content": "Hello w"}
        assert c["finish_reason"] == "length" and c["logprobs"] is None
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 9, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip


def test_max_tokens_vs_max_completion_tokens_reaches_manager(client, fake_tm) -> None:
    client.post(CHAT, json={"messages": MSG, "max_tokens": 4, "max_completion_tokens": 2})
    assert fake_tm.requests[-1].sampling_params["max_new_tokens"] == 2


def test_chat_logprobs_shape(client) -> None:
    body = {"messages": MSG, "logprobs": True, "top_logprobs": 2, "max_tokens": 2}
    lp = client.post(CHAT, json=body).json()["choices"][0]["logprobs"]
    assert lp["refusal"] is None
    assert [e["token"] for e in lp["content"]] == ["Hel", "lo"]
    assert lp["content"][1]["logprob"] == -0.5 and lp["content"][1]["bytes"] == list(b"lo")
    assert [t["token"] for t in lp["content"][1]["top_logprobs"]] == ["lo", "a"]
    no_top = client.post(CHAT, json={"messages": MSG, "logprobs": True, "max_tokens": 1}).json()
    assert no_top["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_chat_stream_logprobs_per_delta(client) -> None:
    body = {"messages": MSG, "logprobs": True, "stream": True, "max_tokens": 3}
    chunks = [e for e in _events(_stream(client, CHAT, body)[1]) if e != "[DONE]"]
    content = [c["choices"][0] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert [[e["token"] for e in c["logprobs"]["content"]] for c in content] == [
        ["Hel"],
        ["lo"],
        [" w"],
    ]


def test_completions_legacy_logprobs_with_echo(client) -> None:
    body = {"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "abHello"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "Hel", "lo"]
    assert lp["token_logprobs"] == [None, -1.0, 0.0, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][3] == {"lo": -0.5}
    assert lp["text_offset"] == [0, 1, 2, 5]


def test_completions_batch_ids_and_n(client) -> None:
    body = {"prompt": [[10, 11], [10]], "n": 2, "max_tokens": 1, "echo": True}
    data = client.post("/v1/completions", json=body).json()
    assert data["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in data["choices"]] == [
        (0, "abHel"), (1, "abHel"), (2, "aHel"), (3, "aHel")]  # fmt: skip
    assert data["usage"]["prompt_tokens"] == 3 and data["usage"]["completion_tokens"] == 4


def test_completions_stream_echo_first_chunk(client) -> None:
    body = {"prompt": "ab", "echo": True, "stream": True, "max_tokens": 2}
    chunks = [e for e in _events(_stream(client, "/v1/completions", body)[1]) if e != "[DONE]"]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == ["abHel", "lo", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


@pytest.mark.parametrize(
    ("content", "code"),
    [(b"{not json", "invalid_json"), (b"[1, 2]", None), (b'{"messages": "hi", "n": "x"}', None),
     (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', None)],
)  # fmt: skip
def test_bad_requests_are_400(client, content: bytes, code: str | None) -> None:
    resp = client.post(CHAT, content=content, headers={"content-type": "application/json"})
    _assert_error(resp, 400, code)
    assert client.post(CHAT, json={"messages": MSG}).status_code == 200


def test_negative_max_tokens_names_param(client) -> None:
    err = _assert_error(client.post(CHAT, json={"messages": MSG, "max_tokens": -1}), 400)
    assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"


def test_unknown_model_and_route_are_404(client) -> None:
    err = _assert_error(
        client.post(CHAT, json={"messages": MSG, "model": "gpt-4"}), 404, "model_not_found"
    )
    assert "fake-model" in err["message"]
    _assert_error(client.get("/v1/nope"), 404)
    assert client.post(CHAT, json={"messages": MSG, "model": ""}).status_code == 200


def test_request_error_mapped(client, fake_tm) -> None:
    fake_tm.fail_with = FakeRequestError("too long", 400, "context_length_exceeded")
    _assert_error(client.post(CHAT, json={"messages": MSG}), 400, "context_length_exceeded")
    resp, _ = _stream(client, CHAT, {"messages": MSG, "stream": True})
    _assert_error(resp, 400, "context_length_exceeded")  # before the first byte: a real status


def test_internal_fault_is_500(client, fake_tm) -> None:
    fake_tm.fail_with = RuntimeError("boom")
    _assert_error(client.post(CHAT, json={"messages": MSG}), 500)


def test_abort_finish_is_an_error(client, fake_tm) -> None:
    fake_tm.abort_at = 2
    _assert_error(client.post(CHAT, json={"messages": MSG}), 503, "oom")
    resp, raw = _stream(client, CHAT, {"messages": MSG, "stream": True})
    assert resp.status_code == 200
    events = _events(raw)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "oom"
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-2])
    assert fake_tm.num_closed == 2


def test_api_key(make_client) -> None:
    client = make_client(api_key="sekret")
    _assert_error(client.post(CHAT, json={"messages": MSG}), 401, "invalid_api_key")
    bad = {"Authorization": "Bearer wrong"}
    _assert_error(client.get("/v1/models", headers=bad), 401)
    ok = {"Authorization": "Bearer sekret"}
    assert client.post(CHAT, json={"messages": MSG}, headers=ok).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert "sekret" not in client.get("/get_server_info", headers=ok).text


def test_not_ready_is_503(client, fake_tm) -> None:
    fake_tm.server_ready = False
    _assert_error(client.post(CHAT, json={"messages": MSG}), 503)
    _assert_error(client.get("/health"), 503)
    fake_tm.server_ready, fake_tm.is_healthy = True, False
    _assert_error(client.get("/health_generate"), 503)


def test_info_routes(client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert (card["id"], card["object"], card["context_length"], card["max_model_len"]) == (
        "fake-model", "model", 64, 64)  # fmt: skip
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    _assert_error(client.get("/v1/models/other"), 404, "model_not_found")
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_server_info").json()
    assert info["port"] == 30000 and info["internal_state"]["kv_total"] == 100
    assert client.post("/tokenize", json={"prompt": "ab"}).json() == {
        "tokens": [0, 10, 11], "count": 3, "max_model_len": 64}  # fmt: skip
    assert client.post("/detokenize", json={"tokens": [10, 11]}).json() == {"text": "ab"}
    assert client.post("/flush_cache").json()["success"] is True


def test_metrics(client) -> None:
    client.post(CHAT, json={"messages": MSG})
    _stream(client, CHAT, {"messages": MSG, "stream": True})
    client.get("/nope")
    text = client.get("/metrics").text
    assert 'sluice_http_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text
    assert 'sluice_http_requests_total{route="other",status="404"} 1.0' in text
    assert "sluice_time_to_first_token_seconds_count 1.0" in text
    assert "sluice_generation_tokens_total 12.0" in text
    assert "sluice_cache_hit_rate 1.0" in text  # 2 cached of 2 prompt tokens, twice
    assert "sluice_kv_total_tokens 100.0" in text


def test_two_apps_do_not_clash(fake_tm) -> None:
    create_app(fake_tm, ServerArgs())
    create_app(fake_tm, ServerArgs())  # a global registry would raise "Duplicated timeseries"


def test_generate_native(client) -> None:
    out = client.post("/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 2}})
    data = out.json()
    assert data["text"] == "Hello" and data["output_ids"] == [4, 5]
    assert data["meta_info"]["finish_reason"] == {"type": "length"}
    assert data["meta_info"]["prompt_tokens"] == 2
    batch = client.post(
        "/generate", json={"input_ids": [[10], [11]], "sampling_params": {"max_new_tokens": 1}}
    )
    assert [d["text"] for d in batch.json()] == ["Hel", "Hel"]
    _, raw = _stream(
        client,
        "/generate",
        {"text": "ab", "stream": True, "sampling_params": {"max_new_tokens": 2}},
    )
    events = _events(raw)
    assert [e["text"] for e in events[:-1]] == ["Hel", "Hello"]
    _assert_error(client.post("/generate", json={"sampling_params": {}}), 400)


def test_keepalive_while_waiting_for_first_token(fake_tm) -> None:
    """No token ever comes (the fake hangs): the stream's first frame is a keep-alive comment;
    the client then leaves, which closes the generator."""
    fake_tm.hang = True
    app = create_app(fake_tm, ServerArgs(), keepalive_interval=0.05)
    sent = _asgi_call(app, {"messages": MSG, "stream": True, "max_tokens": 1}, until_body=True)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 200
    first = next(m["body"] for m in sent if m["type"] == "http.response.body" and m["body"])
    assert first == b": keep-alive\n\n"
    assert fake_tm.num_closed == 1


def _asgi_call(
    app, body: dict, disconnect_after: float = 0.0, until_body: bool = False
) -> list[dict]:
    """Drive the app directly; the client disconnects after `disconnect_after` seconds, or
    (`until_body`) once the first non-empty body frame was sent."""
    sent: list[dict] = []
    got_body = asyncio.Event()
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("t", 1), "server": ("t", 2)}  # fmt: skip
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if until_body:
            await got_body.wait()
        else:
            await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            got_body.set()

    async def main() -> None:
        await asyncio.wait_for(app(scope, receive, send), 60)  # only against a hang

    asyncio.run(main())
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_closes_the_generator(fake_tm, stream: bool) -> None:
    fake_tm.hang = True
    app = create_app(fake_tm, ServerArgs(), keepalive_interval=0.05)
    _asgi_call(app, {"messages": MSG, "stream": stream}, disconnect_after=0.2)
    assert len(fake_tm.requests) == 1
    assert fake_tm.num_closed == 1


# ---- routing of pooled requests (embeddings, score, rerank) ---------------------------------


class _Pooled:
    def __init__(self, name: str, task: str) -> None:
        from sluice.tokenizer.embedding_manager import TASKS

        self.model_name, self.task, self.tasks = name, task, TASKS[task]


def _pick(models: list[Any], model: str | None, task: str, prefer: tuple[str, ...]) -> Any:
    from sluice.server.serving_base import ServingContext
    from sluice.server.serving_embedding import pick_model

    ctx = ServingContext(None, "chat", None, None)  # type: ignore[arg-type]
    return pick_model(ctx, models, model, task, prefer)


def test_pooled_routing_prefers_encoders_then_the_decoder() -> None:
    from sluice.server.errors import APIError
    from sluice.server.serving_rerank import RERANK_PREFERENCE

    cross, emb, dec = _Pooled("ce", "rerank"), _Pooled("emb", "embed"), _Pooled("chat", "generate")
    assert _pick([cross, emb, dec], None, "rerank", RERANK_PREFERENCE) is cross
    assert _pick([emb, dec], None, "rerank", RERANK_PREFERENCE) is emb
    assert _pick([dec], None, "rerank", RERANK_PREFERENCE) is dec
    assert _pick([dec], None, "embed", ("embed", "generate")) is dec
    assert _pick([emb, dec], "chat", "score", ("generate",)) is dec
    for model, status in (("emb", 400), ("ce", 400), ("nope", 404)):
        with pytest.raises(APIError) as err:
            _pick([cross, emb, dec], model, "score", ("generate",))
        assert err.value.status_code == status and err.value.param == "model"
    with pytest.raises(APIError) as err:
        _pick([cross], None, "score", ("generate",))
    assert err.value.status_code == 400


def test_score_prompts_and_label_probabilities() -> None:
    import numpy as np

    from sluice.server.errors import APIError
    from sluice.server.serving_score import label_probabilities, score_prompts

    assert score_prompts("q", ["a", "b"], False) == ["qa", "qb"]
    assert score_prompts("q", "a", True) == ["aq"]
    assert score_prompts([1, 2], [[3], [4, 5]], True) == [[3, 1, 2], [4, 5, 1, 2]]
    for query, items in (("q", []), ("q", [[1]]), ([1], ["a"])):
        with pytest.raises(APIError):
            score_prompts(query, items, False)
    lp = np.log(np.array([0.2, 0.05], dtype=np.float32))
    assert np.allclose(label_probabilities(lp, False), [0.2, 0.05], atol=1e-6)
    assert np.allclose(label_probabilities(lp, True), [0.8, 0.2], atol=1e-6)


def test_yes_no_tokens_must_be_single_tokens() -> None:
    from sluice.server.errors import APIError
    from sluice.server.serving_rerank import yes_no_token_ids

    class Tok:
        def __init__(self, vocab: dict[str, list[int]]) -> None:
            self.vocab = vocab

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return self.vocab.get(text, [0, 0])

    assert yes_no_token_ids(Tok({"yes": [7], " no": [9]})) == [7, 9]
    with pytest.raises(APIError) as err:
        yes_no_token_ids(Tok({"yes": [7]}))
    assert err.value.status_code == 400 and "'no'" in err.value.message


def test_rerank_prompt_ids_cut_long_documents_and_add_no_second_bos() -> None:
    from sluice.checkpoint.hf_dir import load_model_config
    from sluice.server.errors import APIError
    from sluice.server.serving_rerank import rerank_prompt, rerank_prompt_ids
    from sluice.utils.tokenizer import get_tokenizer

    tok = get_tokenizer(load_model_config(None).hf_dir)
    short, long_doc = "Paris is in France.", "word " * 5000
    prompts = rerank_prompt_ids(tok, "Where is Paris?", [short, long_doc], 512)
    assert prompts[0] == tok.encode(
        rerank_prompt(tok, "Where is Paris?", short), add_special_tokens=False
    )
    assert len(prompts[1]) <= 512 and len(prompts[1]) > 400
    assert prompts[1][-5:] == prompts[0][-5:]  # the assistant turn's start survives the cut
    with pytest.raises(APIError) as err:
        rerank_prompt_ids(tok, "q " * 600, [short], 512)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"


# ---- early-end counters and /get_server_info of several models -----------------------------


class _Encoder:
    """An encoder model's manager as the app sees it: `state` is its scheduler's answer, None
    for a scheduler that never answers, an exception for a dead one."""

    is_decoder = False
    context_len, dimensions, task, tasks = 16, 2, "embed", ("embed", "rerank")

    def __init__(self, name: str, state: dict[str, Any] | Exception | None) -> None:
        from sluice.tokenizer.counters import RequestCounters

        self.model_name, self.state = name, state
        self.counters = RequestCounters()

    async def get_internal_state(self) -> dict[str, Any]:
        if self.state is None:
            await asyncio.sleep(3600)
        if isinstance(self.state, Exception):
            raise self.state
        return dict(self.state)


def _sample(text: str, name: str) -> float | None:
    """The value of the sample line `name` of a Prometheus page (None when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_metrics_sum_generation_and_pooled_counters_in_the_same_series(fake_tm) -> None:
    from fastapi.testclient import TestClient

    from sluice.tokenizer.counters import RequestCounters

    fake_tm.counters = RequestCounters()
    fake_tm.counters.count_abort("client_disconnect", 2)
    fake_tm.counters.rejected["queue_full"] += 1
    emb, rerank = _Encoder("emb", {}), _Encoder("ce", {})
    emb.counters.count_abort("client_disconnect", 3)
    emb.counters.count_finish({"type": "abort", "code": "timeout", "matched": "waiting_timeout"})
    rerank.counters.count_abort("shutdown", 4)
    rerank.counters.rejected["queue_full"] += 5
    client = TestClient(create_app(fake_tm, ServerArgs(), embedders=[emb, rerank]))
    text = client.get("/metrics").text
    aborts = "sluice_request_aborts_total"
    assert _sample(text, f'{aborts}{{cause="client_disconnect"}}') == 5.0
    assert _sample(text, f'{aborts}{{cause="shutdown"}}') == 4.0
    assert _sample(text, f'{aborts}{{cause="timeout"}}') == 1.0
    assert _sample(text, f'{aborts}{{cause="abort_request"}}') == 0.0
    assert _sample(text, 'sluice_request_timeouts_total{kind="waiting"}') == 1.0
    assert _sample(text, 'sluice_rejected_requests_total{reason="queue_full"}') == 6.0
    assert _sample(text, "sluice_unknown_rid_outputs_total") == 0.0
    emb.counters.count_abort("abort_request")  # read at scrape time
    text = client.get("/metrics").text
    assert _sample(text, f'{aborts}{{cause="abort_request"}}') == 1.0


def test_metrics_count_an_encoder_main_models_manager_once(fake_tm) -> None:
    """The main model is an encoder: its manager is the frontend's and also among the app's
    embedders; its counts appear once."""
    from fastapi.testclient import TestClient

    main = _Encoder("fake-model", {})
    main.counters.count_abort("abort_request", 3)
    fake_tm.manager = main  # what EncoderFrontend exposes; it has no counters of its own
    client = TestClient(create_app(fake_tm, ServerArgs(), embedders=[main]))
    text = client.get("/metrics").text
    assert _sample(text, 'sluice_request_aborts_total{cause="abort_request"}') == 3.0


def test_server_info_reports_each_encoder_and_never_hangs_on_one(fake_tm, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from sluice.server import app as app_module
    from sluice.tokenizer.normalize import RequestError

    monkeypatch.setattr(app_module, "STATE_TIMEOUT_S", 0.2)
    state = {"num_running_reqs": 0, "num_waiting_reqs": 3, "num_req_states": 4}
    dead = RequestError("the embedding process died", status_code=503)
    encoders = [_Encoder("emb", state), _Encoder("ce", None), _Encoder("other", dead)]
    client = TestClient(create_app(fake_tm, ServerArgs(), embedders=encoders))
    resp = client.get("/get_server_info")
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["internal_state"] == fake_tm.state  # the main model's, unchanged
    states = info["encoder_internal_states"]
    assert states["emb"] == {"available": True, **state}
    assert states["ce"] == {
        "available": False,
        "error": "the scheduler did not answer within 0.2 s",
    }
    assert states["other"] == {"available": False, "error": "the embedding process died"}


def test_server_info_lists_no_encoder_for_an_encoder_main_model(fake_tm) -> None:
    """The main model's own manager answers as `internal_state`, not twice."""
    from fastapi.testclient import TestClient

    main, extra = _Encoder("fake-model", {"num_waiting_reqs": 1}), _Encoder("ce", {})
    fake_tm.manager = main
    client = TestClient(create_app(fake_tm, ServerArgs(), embedders=[main, extra]))
    info = client.get("/get_server_info").json()
    assert list(info["encoder_internal_states"]) == ["ce"]
    assert client.get("/v1/models/fake-model").status_code == 200  # still routed


def test_server_info_without_encoders_has_an_empty_map(client) -> None:
    assert client.get("/get_server_info").json()["encoder_internal_states"] == {}


@pytest.mark.parametrize(
    "content",
    [b'{"messages": [], "temperature": NaN}', b'{"messages": [], "max_tokens": Infinity}',
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"[" * 100_000,
     b'{"messages": [{"role": "user", "content": "\xff"}]}',
     # JSON in UTF-16 (json.loads would take it), with a lone surrogate the encoding hides
     '{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}'.encode("utf-16"),
     '{"messages": [{"role": "user", "content": "hi"}]}'.encode("utf-32-le")],
)  # fmt: skip
def test_not_strict_json_is_a_400(client, content: bytes) -> None:
    resp = client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", resp.text


def test_surrogate_pairs_are_text(client, fake_tm) -> None:
    body = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'
    resp = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert fake_tm.templates[-1][0]["content"] == "😀"


@pytest.mark.parametrize(
    "body",
    [b'{"a": [1, -0.0, 1.5e-320, 123456789012345678901234567890, true, null]}',
     b'{"a": "\\u00e9\\ud83d\\ude00\\n\\/", "a": "last wins", "b": "\x7f\xc3\xa9"}',
     b' {"a": 1e400} ', b'{"messages": [{"content": "' + b"A" * 300_000 + b'"}]}'],
)  # fmt: skip
def test_valid_json_decodes_as_json_does(body: bytes) -> None:
    """Whichever decoder answers (msgspec first, json for a number past the float range)."""
    from sluice.server.serving_base import decode_json

    assert decode_json(body) == json.loads(body.decode())


def test_a_request_error_raised_in_any_route_is_its_400(client, fake_tm) -> None:
    async def refuse(*args, **kwargs):
        raise RequestError("give a rid or abort_all", param="rid")

    fake_tm.abort_request = refuse
    resp = client.post("/abort_request", json={})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "rid"
