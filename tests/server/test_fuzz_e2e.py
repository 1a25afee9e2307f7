"""Malformed requests against the real server: every answer is a 2xx or a 4xx with an OpenAI error
body, the server keeps serving, and nothing is left behind.

One server (the tiny random Llama, which also embeds, scores and reranks) for the module.
Hypothesis takes a valid body of each route and changes one thing: a value (at any depth) into
a wrong type, an out-of-range number (huge, negative, NaN / Infinity as JSON tokens), a huge
string or array; a field removed; an unknown field added. Raw bodies are broken JSON, bad UTF-8
and other non-objects. Runs are reproducible (`derandomize`) and bounded (`max_examples`, short
generations). A 503 is accepted only as a timeout the body asked for, a 429 only as overload.
Besides the random changes, every integer of every valid body is set, in turn, beyond int64
(what the wire to the scheduler carries): each must be a 400 that names the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.live_server import LiveServer, assert_no_state_left, running_server

CONTEXT_LEN = 512  # the tiny model's max_position_embeddings
MESSAGES = [{"role": "user", "content": "Say hi."}]
# statuses outside 2xx/4xx that a body may earn, with the codes that explain them
OVERLOAD_CODES = {429: {"queue_full"}, 503: {"timeout"}}


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck), print_blob=False,
    )  # fmt: skip


# ---- the server and how answers are judged --------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("fuzz_e2e") / "server.log"
    args = ["--max-total-tokens", "4096", "--log-level", "warning", "--no-embedding-model"]
    with running_server(tiny_llama_dir, args, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=120) as client:
        yield client


def assert_error_body(body: Any, status: int) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if status >= 500 or status == 429:
        assert err["code"] in OVERLOAD_CODES.get(status, ()), (status, err)
    return err


def assert_sse_body(text: str) -> None:
    """Every frame is a keepalive comment or JSON data; an error frame is a client error or a
    timeout, never an internal one."""
    assert text.endswith("data: [DONE]\n\n"), text[-500:]
    for frame in text.split("\n\n")[:-1]:
        if frame.startswith(":"):
            continue
        assert frame.startswith("data: "), frame[:200]
        payload = frame[len("data: ") :]
        if payload == "[DONE]":
            continue
        data = json.loads(payload)
        if isinstance(data, dict) and "error" in data:
            kind = data["error"].get("type")
            status = {"server_error": 500, "service_unavailable": 503}.get(kind, 400)
            assert_error_body(data, status)


def send(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` (bytes as they are, anything else as JSON with NaN / Infinity tokens allowed)
    and check the answer; returns the response, read."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http.post(path, content=content, headers={"content-type": "application/json"})
    status = resp.status_code
    assert 200 <= status < 300 or 400 <= status < 500 or status in OVERLOAD_CODES, (
        status, path, content[:300], resp.text[:1000],
    )  # fmt: skip
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert status == 200, resp.text[:500]
        assert_sse_body(resp.text)
    elif status >= 300:
        assert_error_body(resp.json(), status)
    else:
        resp.json()  # every 2xx body is JSON
    return resp


# ---- valid bodies and one change to each ----------------------------------------------------

HUGE_INTS = [2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63), -(2**63) - 1, -(2**70), 10**30]
SMALL_INTS = [-(2**31), -2, -1, 0, 1, 2, 3]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0]
ODD_STRINGS = ["", " ", "x", "\ud800", "\x00", "你好🎉", "NaN", "-1", "1e400", "null", str(2**64)]
HUGE_STRINGS = ["x" * 100_000, "é" * 30_000]
HUGE_ARRAYS: list[Any] = [[1] * 5_000, ["a"] * 200, [[1, 2]] * 100, [{}] * 200]
# names worth adding where they are missing: every integer field of some route, and more
FIELD_NAMES = [
    "seed", "n", "max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "top_k",
    "logprobs", "top_logprobs", "top_logprobs_num", "logprob_start_len", "logit_bias",
    "stop_token_ids", "session_params", "offset", "rid", "timeout", "stream", "dimensions",
    "truncate_prompt_tokens", "label_token_ids", "top_n", "capacity_of_str_len", "input_ids",
    str(2**64), "-1",
]  # fmt: skip

scalars = st.one_of(
    st.sampled_from(HUGE_INTS + SMALL_INTS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),  # NaN / Infinity become JSON tokens
    st.sampled_from([None, True, False, [], {}, *ODD_STRINGS]),
    st.text(max_size=12),
)
wild = st.one_of(
    scalars,
    st.sampled_from(HUGE_STRINGS + HUGE_ARRAYS),
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=6) | st.sampled_from(FIELD_NAMES), scalars, max_size=3),
)


def _out_of_range(value: Any) -> st.SearchStrategy[Any]:
    """Values of the same kind as `value`, but out of any range it may have."""
    if isinstance(value, bool):
        return st.sampled_from([0, 1, "true", None])
    if isinstance(value, int):
        return st.sampled_from(HUGE_INTS + SMALL_INTS) | st.integers()
    if isinstance(value, float):
        return st.sampled_from(ODD_FLOATS) | st.floats()
    if isinstance(value, str):
        return st.sampled_from(ODD_STRINGS + HUGE_STRINGS)
    if isinstance(value, list):
        return st.sampled_from([[], *HUGE_ARRAYS]) | st.lists(st.sampled_from(HUGE_INTS))
    return st.dictionaries(st.sampled_from([*FIELD_NAMES, *map(str, HUGE_INTS)]), scalars)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place inside `value` (dict keys and list indexes, at any depth)."""
    out: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        out.append((*prefix, key))
        if isinstance(child, dict | list) and child:
            out.extend(_paths(child, (*prefix, key)))
    return out


def _is_int_place(body: Any, path: tuple[Any, ...]) -> bool:
    """Whether `path` holds an integer, or is a dict key that spells one (a logit_bias key)."""
    holder = body
    for key in path[:-1]:
        holder = holder[key]
    value = holder[path[-1]]
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return is_int or (isinstance(path[-1], str) and path[-1].isdigit())


@st.composite
def mutated(draw: st.DrawFn, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """A copy of one of `bodies` with one change: a value replaced (half the time an integer,
    the wire's weak spot), a key removed or renamed, or a field added (anywhere)."""
    body = json.loads(json.dumps(draw(st.sampled_from(bodies))))
    paths = _paths(body)
    names = st.sampled_from(FIELD_NAMES) | st.text(min_size=1, max_size=12)
    if not paths:  # {}: only a field can be added
        body[draw(names)] = draw(wild)
        return body
    int_paths = [p for p in paths if _is_int_place(body, p)]
    if int_paths and draw(st.booleans()):
        paths = int_paths
    *parents, last = draw(st.sampled_from(paths))
    holder: Any = body
    for key in parents:
        holder = holder[key]
    action = draw(st.sampled_from(["replace", "replace", "replace", "remove", "rename", "add"]))
    if action == "remove" and isinstance(holder, dict):
        del holder[last]
    elif action == "rename" and isinstance(holder, dict):
        keys = st.sampled_from([str(i) for i in HUGE_INTS + SMALL_INTS]) | names
        holder[draw(keys)] = holder.pop(last)
    elif action == "add" and isinstance(holder, dict):
        holder[draw(names)] = draw(wild)
    else:
        holder[last] = draw(_out_of_range(holder[last]) | wild)
    return body


# float fields hold floats (0.0, not 0): every int in these bodies is an integer field. Chat
# bodies carry both length limits (the smaller wins), so no one change makes a long generation.
GEN = {"temperature": 0.0, "max_tokens": 3}
CHAT_GEN = {**GEN, "max_completion_tokens": 3}
CHAT_BODIES = [
    {"messages": MESSAGES, **CHAT_GEN},
    {"messages": MESSAGES, **CHAT_GEN, "n": 2, "seed": 7, "top_k": 5, "top_p": 0.9, "stop": ["x"],
     "logit_bias": {"12": -5.0}, "stop_token_ids": [3], "min_tokens": 1},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     **CHAT_GEN, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2, "logprobs": True,
     "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
     "repetition_penalty": 1.1, "timeout": 30.0},
]  # fmt: skip
COMPLETION_BODIES = [
    {"prompt": "Once upon a time", **GEN},
    {"prompt": [[1, 2, 3], [4, 5]], **GEN, "n": 2, "echo": True, "logprobs": 1},
    {"prompt": ["a", "b"], **GEN, "stream": True, "seed": 3, "min_p": 0.1},
    {"prompt": [10, 11, 12], "max_tokens": 2, "ignore_eos": True, "skip_special_tokens": False},
]
GENERATE_BODIES = [
    {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}},
    {"input_ids": [[1, 2], [3, 4]], "rid": ["fz-a", "fz-b"],
     "sampling_params": {"max_new_tokens": 2, "n": 1, "seed": 5, "top_k": 3,
                         "stop_token_ids": [7], "logit_bias": {"9": 1.5}}},
    {"text": ["x", "y"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 1}],
     "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "stream": True},
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 1,
     "stop": ["a"], "ignore_eos": True}, "timeout": 30.0},
    {"text": "hi", "session_params": {"id": "fz-none", "offset": 0},
     "sampling_params": {"max_new_tokens": 2}},
]  # fmt: skip
EMBEDDING_BODIES = [
    {"input": "a sentence"},
    {"input": ["one", "two"], "encoding_format": "base64", "dimensions": 16},
    {"input": [[1, 2, 3], [4]], "truncate_prompt_tokens": 2},
    {"input": [7, 8, 9], "encoding_format": "float", "user": "u"},
]
RERANK_BODIES = [
    {"query": "cats", "documents": ["a cat", "a dog"]},
    {"query": "q", "documents": [{"text": "doc"}, "other"], "top_n": 1, "return_documents": False},
]
SCORE_BODIES = [
    {"query": "Is it food? ", "items": ["pasta", "stocks"], "label_token_ids": [1, 2]},
    {
        "query": [1, 2],
        "items": [[3], [4, 5]],
        "label_token_ids": [7],
        "apply_softmax": True,
        "item_first": True,
    },
]
ABORT_BODIES = [{"rid": "no-such-rid"}, {"abort_all": True}]
OPEN_SESSION_BODIES = [{}, {"session_id": "fz-open", "timeout": 30.0, "capacity_of_str_len": 64}]
CLOSE_SESSION_BODIES = [{"session_id": "fz-none"}]


def _close_opened(http: httpx.Client, resp: httpx.Response) -> None:
    if resp.status_code == 200 and isinstance(resp.json(), str):
        assert http.post("/close_session", json={"session_id": resp.json()}).status_code == 200


# ---- the fuzz tests, one per route family ---------------------------------------------------


@_settings(70)
@given(body=mutated(CHAT_BODIES))
def test_chat_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    send(http, "/v1/chat/completions", body)


@_settings(45)
@given(body=mutated(COMPLETION_BODIES))
def test_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    send(http, "/v1/completions", body)


@_settings(45)
@given(body=mutated(GENERATE_BODIES))
def test_generate(http: httpx.Client, body: dict[str, Any]) -> None:
    send(http, "/generate", body)


@_settings(50)
@given(
    route=st.sampled_from(["/v1/embeddings", "/v1/rerank", "/v1/score"]),
    data=st.data(),
)
def test_pooled_routes(http: httpx.Client, route: str, data: st.DataObject) -> None:
    bodies = {"/v1/embeddings": EMBEDDING_BODIES, "/v1/rerank": RERANK_BODIES,
              "/v1/score": SCORE_BODIES}[route]  # fmt: skip
    send(http, route, data.draw(mutated(bodies)))


@_settings(40)
@given(route=st.sampled_from(["open", "close", "abort", "turn"]), data=st.data())
def test_sessions_and_abort(http: httpx.Client, route: str, data: st.DataObject) -> None:
    if route == "open":
        _close_opened(http, send(http, "/open_session", data.draw(mutated(OPEN_SESSION_BODIES))))
    elif route == "close":
        send(http, "/close_session", data.draw(mutated(CLOSE_SESSION_BODIES)))
    elif route == "abort":
        send(http, "/abort_request", data.draw(mutated(ABORT_BODIES)))
    else:  # a turn of an open session, its session_params (or anything else) changed
        opened = send(http, "/open_session", {"timeout": 30.0})
        try:  # closed even when Hypothesis ends the example in the draw
            session = {"id": opened.json(), "offset": 0, "replace": False,
                       "drop_previous_output": False}  # fmt: skip
            turn = {
                "text": "hi",
                "session_params": session,
                "sampling_params": {"max_new_tokens": 2},
            }
            send(http, "/generate", data.draw(mutated([turn])))
        finally:
            _close_opened(http, opened)


RAW_VALID = json.dumps(CHAT_BODIES[1]).encode()
RAW_BODIES = [
    b"", b"{", b"}", b"null", b"[]", b"[1, 2]", b'"text"', b"42", b"true", b"{'single': 1}",
    b'{"messages": NaN}', b'{"max_tokens": Infinity, "messages": []}', b"[" * 50_000,
    b'{"a":' * 50_000, b"\xff\xfe\xfd", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
    b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
    b'{"max_tokens": 1' + b"0" * 5_000 + b', "messages": []}',
]  # fmt: skip


@st.composite
def broken_json(draw: st.DrawFn) -> bytes:
    """A valid chat body cut short, or with bytes replaced by invalid UTF-8 or stray
    punctuation, or a fixed malformed body."""
    kind = draw(st.sampled_from(["cut", "bytes", "fixed"]))
    if kind == "fixed":
        return draw(st.sampled_from(RAW_BODIES))
    at = draw(st.integers(0, len(RAW_VALID) - 1))
    if kind == "cut":
        return RAW_VALID[:at]
    junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b",", b"}", b'"']))
    return RAW_VALID[:at] + junk + RAW_VALID[at + 1 :]


@_settings(40)
@given(
    route=st.sampled_from(
        ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings",
         "/v1/rerank", "/v1/score", "/open_session", "/close_session", "/abort_request"]
    ),
    body=broken_json(),
)  # fmt: skip
def test_broken_bodies(http: httpx.Client, route: str, body: bytes) -> None:
    resp = send(http, route, body)
    _close_opened(http, resp)


# ---- every integer field, out of range ------------------------------------------------------

INT_SWEEP_BODIES = [
    ("/v1/chat/completions", CHAT_BODIES), ("/v1/completions", COMPLETION_BODIES),
    ("/generate", GENERATE_BODIES), ("/v1/embeddings", EMBEDDING_BODIES),
    ("/v1/rerank", RERANK_BODIES), ("/v1/score", SCORE_BODIES),
    ("/open_session", OPEN_SESSION_BODIES),
]  # fmt: skip
BEYOND_WIRE = [2**64, -(2**63) - 1]  # what msgpack (the wire to the scheduler) cannot carry


def _int_variants(body: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(path, body with the integer at path, or the integer key at path, beyond the wire)."""
    for path in _paths(body):
        if not _is_int_place(body, path):
            continue
        for value in BEYOND_WIRE:
            copy = json.loads(json.dumps(body))
            holder = copy
            for key in path[:-1]:
                holder = holder[key]
            if isinstance(path[-1], str) and path[-1].isdigit():  # a token-id key
                holder[str(value)] = holder.pop(path[-1])
            else:
                holder[path[-1]] = value
            yield path, copy


def test_every_integer_field_beyond_the_wire_is_a_400(http: httpx.Client) -> None:
    """Each integer of each valid body, in turn, set beyond int64: a 400 that names the field
    and its range (or the vocabulary, for a token id of a prompt)."""
    num_checked = 0
    for route, bodies in INT_SWEEP_BODIES:
        for body in bodies:
            for path, variant in _int_variants(body):
                resp = send(http, route, variant)
                _close_opened(http, resp)
                assert resp.status_code == 400, (route, path, resp.text)
                err = resp.json()["error"]
                assert err["param"], (route, path, err)
                words = ("must be an integer in [", "outside the vocabulary")
                assert any(w in err["message"] for w in words), (route, path, err)
                num_checked += 1
    assert num_checked > 80


# ---- regressions found here, and the state afterwards --------------------------------------


def test_seed_above_int64_is_400_naming_seed(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "seed": 1180591620717411303424}
    resp = send(http, "/v1/chat/completions", body)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "seed", err
    assert "[-9223372036854775808, 9223372036854775807]" in err["message"], err


def test_failed_open_session_leaves_later_ones_working(http: httpx.Client) -> None:
    """A session request refused before it reached the scheduler must not take the next one's
    reply (it used to leave every later open_session waiting 60 s)."""
    resp = send(http, "/open_session", {"capacity_of_str_len": 2**70})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "capacity_of_str_len"
    opened = send(http, "/open_session", {"session_id": "fz-after"})
    assert opened.status_code == 200 and opened.json() == "fz-after"
    _close_opened(http, opened)


def test_completions_default_to_16_tokens_and_chat_to_the_context(http: httpx.Client) -> None:
    usage = send(http, "/v1/completions", {"prompt": "Hi", "ignore_eos": True}).json()["usage"]
    assert usage["completion_tokens"] == 16, usage
    body = {"messages": MESSAGES, "ignore_eos": True}
    usage = send(http, "/v1/chat/completions", body).json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT_LEN, usage


def test_still_serving_and_nothing_left_behind(server: LiveServer, http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] > 0, resp.text
    state = server.wait_for(lambda s: s["num_sessions"] == 0 and s["num_running_reqs"] == 0)
    assert_no_state_left(server.wait_idle())
    assert state["num_sessions"] == 0
    statuses = [
        line for line in server.metrics().splitlines()
        if line.startswith("sluice_http_requests_total{") and 'status="5' in line
    ]  # fmt: skip
    assert all('status="503"' in line for line in statuses), statuses  # timeouts only
    assert "internal error" not in Path(server.log).read_text()
