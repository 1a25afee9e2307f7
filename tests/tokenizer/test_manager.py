"""The TokenizerManager driving real scheduler and detokenizer processes (tiny random model).

One set of processes for the module; after every test the server must be idle with no state
left in any process and every KV slot free or cached.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from sluice.config import ServerArgs
from sluice.launch import ServingProcesses
from sluice.tokenizer.generate_input import GenerateReqInput
from sluice.tokenizer.manager import RequestError, TokenizerManager

CONTEXT_LEN = 512  # the tiny model's max_position_embeddings
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@dataclass
class Serving:
    loop: asyncio.AbstractEventLoop
    tm: TokenizerManager

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 60))

    def collect(self, **kwargs: Any) -> list[dict[str, Any]]:
        async def go() -> list[dict[str, Any]]:
            return [o async for o in self.tm.generate_request(GenerateReqInput(**kwargs))]

        return self.run(go())

    def error(self, **kwargs: Any) -> RequestError:
        with pytest.raises(RequestError) as info:
            self.collect(**kwargs)
        return info.value


@pytest.fixture(scope="module")
def serving(tiny_llama_dir: str) -> Iterator[Serving]:
    args = ServerArgs(
        model_path=tiny_llama_dir, max_total_tokens=4096, check_invariants=True,
        no_embedding_model=True,
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    procs = ServingProcesses(args)
    tm = loop.run_until_complete(procs.__aenter__())
    try:
        yield Serving(loop, tm)
    finally:
        loop.run_until_complete(procs.__aexit__(None, None, None))
        loop.close()


async def wait_idle(tm: TokenizerManager, timeout: float = 10.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state = await tm.get_internal_state()
        busy = state["num_running_reqs"] + state["num_waiting_reqs"]
        left = busy + state["num_req_states"] + state["num_detokenizer_states"]
        if left == 0 or asyncio.get_running_loop().time() > deadline:
            return state
        await asyncio.sleep(0.05)


@pytest.fixture(autouse=True)
def idle_after(serving: Serving) -> Iterator[None]:
    yield
    state = serving.run(wait_idle(serving.tm))
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0, state
    assert state["num_req_states"] == 0 and state["num_detokenizer_states"] == 0, state
    assert state["kv_free"] + state["kv_cached"] == state["kv_total"], state
    assert serving.tm.is_healthy


def final(outs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    done = {o["index"]: o for o in outs if o["meta_info"]["finish_reason"] is not None}
    assert len(done) == len({o["index"] for o in outs})
    return done


# ---- generation ---------------------------------------------------------------------------


def test_single_text_request(serving: Serving) -> None:
    outs = serving.collect(text="Hello world", sampling_params=GREEDY, rid="single")
    assert len(outs) == 1
    out = outs[0]
    meta = out["meta_info"]
    assert out["index"] == 0 and meta["id"] == "single"
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["prompt_tokens"] == len(serving.run(serving.tm.tokenize("Hello world")))
    assert meta["e2e_latency"] > 0
    assert out["text"] == out["delta"]
    expected = serving.tm.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"] == expected


def test_input_ids_prompt_matches_text_prompt(serving: Serving) -> None:
    ids = serving.run(serving.tm.tokenize("Once upon a time"))
    by_text = serving.collect(text="Once upon a time", sampling_params=GREEDY)[0]
    by_ids = serving.collect(input_ids=ids, sampling_params=GREEDY)[0]
    assert by_ids["output_ids"] == by_text["output_ids"]


def test_batch_is_one_result_per_prompt(serving: Serving) -> None:
    prompts = ["The sky is", "Two plus two", "A quick brown fox"]
    outs = final(serving.collect(text=prompts, sampling_params=GREEDY, rid="batch"))
    assert sorted(outs) == [0, 1, 2]
    assert [outs[i]["meta_info"]["id"] for i in range(3)] == ["batch-0", "batch-1", "batch-2"]
    for i, prompt in enumerate(prompts):
        alone = serving.collect(text=prompt, sampling_params=GREEDY)[0]
        assert outs[i]["output_ids"] == alone["output_ids"]


def test_parallel_samples(serving: Serving) -> None:
    params = {"n": 3, "temperature": 1.0, "max_new_tokens": 12, "seed": 7, "ignore_eos": True}
    prompt = "In a distant galaxy, far away from everything we know, there lived a"
    outs = final(serving.collect(text=[prompt, "Hi"], sampling_params=params, rid="par"))
    assert sorted(outs) == list(range(6))  # index = prompt_index * n + sample_index
    assert outs[4]["meta_info"]["id"] == "par-4"
    samples = [tuple(outs[i]["output_ids"]) for i in range(3)]
    assert len(set(samples)) == 3, "seeded samples of one prompt must differ"
    again = final(serving.collect(text=[prompt, "Hi"], sampling_params=params))
    assert [again[i]["output_ids"] for i in range(6)] == [outs[i]["output_ids"] for i in range(6)]


def test_streaming_deltas_concatenate_to_final_text(serving: Serving) -> None:
    params = {**GREEDY, "max_new_tokens": 24}
    chunks = serving.collect(text=["Let me tell you", "Why"], sampling_params=params, stream=True)
    assert len(chunks) > 2
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["delta"] for c in mine) == mine[-1]["text"]
        lens = [len(c["output_ids"]) for c in mine]
        assert lens == sorted(lens) and lens[0] < lens[-1] == 24
        whole = serving.collect(text=["Let me tell you", "Why"][index], sampling_params=params)
        assert whole[0]["text"] == mine[-1]["text"]


def test_a_tick_adds_keepalive_nones_and_changes_nothing_else(serving: Serving) -> None:
    """While the scheduler is paused (so by construction nothing comes back), the call yields a
    None per tick; resumed, the updates add up as those of a call without a tick."""
    params = {**GREEDY, "max_new_tokens": 12}
    obj = {"text": ["Let me tell you", "Why"], "sampling_params": params, "stream": True}

    async def go() -> list[Any]:
        got: list[Any] = []
        serving.tm.set_paused(True)  # ordered before the request: one socket
        try:
            async for o in serving.tm.generate_request(GenerateReqInput(**obj), 0.01):
                got.append(o)
                if got == [None, None, None]:
                    serving.tm.set_paused(False)
        finally:
            serving.tm.set_paused(False)
        return got

    ticked = serving.run(go())
    assert ticked[:3] == [None, None, None] and ticked[-1] is not None
    plain = final(serving.collect(**obj))
    for index in (0, 1):
        mine = [o for o in ticked if o is not None and o["index"] == index]
        assert "".join(o["delta"] for o in mine) == mine[-1]["text"] == plain[index]["text"]
        assert mine[-1]["meta_info"]["finish_reason"] is not None


def test_absent_max_new_tokens_fills_the_context(serving: Serving) -> None:
    ids = list(range(100, 100 + CONTEXT_LEN - 5))
    out = serving.collect(input_ids=ids, sampling_params={"ignore_eos": True})[0]
    assert out["meta_info"]["completion_tokens"] == 5
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_logprobs(serving: Serving) -> None:
    ids = serving.run(serving.tm.tokenize("Logprobs of this prompt"))
    out = serving.collect(
        input_ids=ids, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
        logprob_start_len=0, stream=True,
    )  # fmt: skip
    meta = out[-1]["meta_info"]
    assert [t for _, t in meta["output_token_logprobs"]] == out[-1]["output_ids"]
    assert all(lp <= 0 for lp, _ in meta["output_token_logprobs"])
    assert sum(c["new_logprob_count"] for c in out) == 8
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert [t for _, t in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None


# ---- validation ---------------------------------------------------------------------------


def test_context_length_error_quotes_the_numbers(serving: Serving) -> None:
    err = serving.error(input_ids=[5] * 500, sampling_params={"max_new_tokens": 100})
    assert err.status_code == 400 and err.code == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT_LEN} tokens" in err.message
    assert "you requested 600 tokens (500 in the messages, 100 in the completion)" in err.message
    err = serving.error(input_ids=[5] * CONTEXT_LEN)
    assert err.code == "context_length_exceeded" and f"{CONTEXT_LEN} tokens" in err.message


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": "hot"}, "temperature"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
        ({"bogus": 1}, "bogus"),
        # beyond what the wire to the scheduler carries (int64), or outside the vocabulary
        ({"seed": 2**70}, "seed"),
        ({"top_k": 2**64}, "top_k"),
        ({"min_new_tokens": 2**64}, "min_new_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logit_bias": {str(2**64): 1.0}}, "logit_bias"),
        ({"logit_bias": {"49152": 1.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_name_the_field(
    serving: Serving, params: dict[str, Any], param: str
) -> None:
    err = serving.error(text="hi", sampling_params=params)
    assert (err.status_code, err.param) == (400, param), err.message


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"text": ""}, "text", "empty"),
        ({"input_ids": []}, "input_ids", "empty"),
        ({"input_ids": [1, 49152]}, "input_ids", "vocabulary"),
        ({"input_ids": [1, -3]}, "input_ids", "vocabulary"),
        ({"text": "a", "input_ids": [1]}, "text", "exactly one"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "one per prompt"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid", "distinct"),
    ],
)
def test_bad_prompts(serving: Serving, kwargs: dict[str, Any], param: str, words: str) -> None:
    err = serving.error(**kwargs)
    assert err.param == param and words in err.message, err.message


def test_duplicate_rid_in_flight_is_rejected(serving: Serving) -> None:
    async def go() -> None:
        params = {"max_new_tokens": 400, "ignore_eos": True}
        gen = serving.tm.generate_request(
            GenerateReqInput(text="x", sampling_params=params, rid="dup", stream=True)
        )
        await gen.__anext__()
        with pytest.raises(RequestError) as info:
            await serving.tm.generate_request(GenerateReqInput(text="y", rid="dup")).__anext__()
        assert info.value.param == "rid"
        await gen.aclose()

    serving.run(go())


# ---- abort and disconnect -----------------------------------------------------------------


def test_abort_request_finishes_it_and_frees_everything(serving: Serving) -> None:
    async def go() -> list[dict[str, Any]]:
        params = {"max_new_tokens": 450, "ignore_eos": True, "n": 2}
        gen = serving.tm.generate_request(
            GenerateReqInput(text="abort me", sampling_params=params, rid="ab", stream=True)
        )
        outs = [await gen.__anext__()]
        assert serving.tm.rid_to_state
        await serving.tm.abort_request("ab")  # the client's rid covers both samples
        outs += [o async for o in gen]
        return outs

    outs = final(serving.run(go()))
    for out in outs.values():
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert out["meta_info"]["completion_tokens"] < 450


def test_consumer_going_away_aborts_its_requests(serving: Serving) -> None:
    async def go() -> dict[str, Any]:
        params = {"max_new_tokens": 450, "ignore_eos": True}
        task_started = asyncio.Event()

        async def consume() -> None:
            req = GenerateReqInput(text=["a", "b"], sampling_params=params, stream=True)
            async for _ in serving.tm.generate_request(req):
                task_started.set()

        task = asyncio.create_task(consume())
        await task_started.wait()
        task.cancel()  # like a client disconnect
        await asyncio.gather(task, return_exceptions=True)
        assert not serving.tm.rid_to_state
        return await wait_idle(serving.tm)

    state = serving.run(go())
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0


# ---- other services -----------------------------------------------------------------------


def test_chat_template_and_tokenize_roundtrip(serving: Serving) -> None:
    tm = serving.tm
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    prompt = tm.apply_chat_template([{"role": "user", "content": parts}])
    assert "Hello\nthere" in prompt and prompt.index("Hello") > 0
    assert prompt == tm.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])
    ids = serving.run(tm.tokenize(prompt, add_special_tokens=False))
    assert serving.run(tm.detokenize(ids)) == prompt
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(RequestError) as info:
        tm.apply_chat_template([{"role": "user", "content": image}])
    assert info.value.status_code == 400 and info.value.param == "messages[0].content"
    assert "accepts text only" in info.value.message
    err = serving.error(text="hi", image_data="data:image/png;base64,AAAA")
    assert err.status_code == 400 and "accepts text only" in err.message
    assert tm.images is None  # a text-only model has no media manager: no pool ever starts
    with pytest.raises(RequestError):
        tm.apply_chat_template([{"content": "no role"}])


def test_flush_cache_empties_the_radix_cache(serving: Serving) -> None:
    serving.collect(text="something to cache", sampling_params=GREEDY)
    assert serving.run(wait_idle(serving.tm))["kv_cached"] > 0
    assert serving.run(serving.tm.flush_cache()) is True
    state = serving.run(serving.tm.get_internal_state())
    assert state["kv_cached"] == 0 and state["kv_free"] == state["kv_total"]


def test_abort_while_tokenizing_never_reaches_the_scheduler(serving: Serving) -> None:
    async def go() -> dict[str, Any]:
        tm = serving.tm
        gen = tm.generate_request(GenerateReqInput(text="x " * 300, rid="tok", stream=True))
        first = asyncio.ensure_future(gen.__anext__())
        while "tok" not in tm.rid_to_state:  # registered, now awaiting the tokenizer thread
            await asyncio.sleep(0)
        assert not tm.rid_to_state["tok"].is_sent
        assert await tm.abort_request("tok") == 1
        out = await first
        assert not tm.awaiting_echo and not tm.rid_to_state  # nothing was sent, nothing awaited
        assert await tm.abort_request("tok") == 0  # idempotent
        await gen.aclose()
        return out

    out = serving.run(go())
    assert out["meta_info"]["finish_reason"]["code"] == "request_aborted"
    assert serving.tm.counters.unknown_rid_outputs == 0


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_logprobs_num": 2**64, "return_logprob": True}, "top_logprobs_num"),
        ({"logprob_start_len": 2**64}, "logprob_start_len"),
        ({"session_params": {"id": "s", "offset": 2**64}}, "session_params.offset"),
        ({"session_params": {"id": "s", "offset": -1}}, "session_params.offset"),
    ],
)
def test_integers_beyond_int64_are_400s_not_send_errors(
    serving: Serving, kwargs: dict[str, Any], param: str
) -> None:
    err = serving.error(text="hi", sampling_params={"max_new_tokens": 1}, **kwargs)
    assert (err.status_code, err.param) == (400, param), err.message
    assert "must be an integer in [" in err.message


def test_a_control_message_that_fails_to_encode_leaves_the_next_one_its_reply(
    serving: Serving,
) -> None:
    """open_session used to queue its waiter before sending: a message that could not be
    encoded left a waiter that took the next call's reply (every later call then timed out)."""

    async def go() -> str:
        with pytest.raises(OverflowError):
            await serving.tm.open_session("bad", 0.0, 2**70)
        sid = await asyncio.wait_for(serving.tm.open_session("good"), 10)
        serving.tm.close_session(sid)
        return sid

    assert serving.run(go()) == "good"


def test_short_texts_are_encoded_on_the_loop_unless_the_thread_is_busy(
    serving: Serving, monkeypatch: pytest.MonkeyPatch
) -> None:
    tm = serving.tm
    threads: list[str] = []
    encode = tm.tokenizer.encode

    def spy(*args: Any, **kwargs: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tm.tokenizer, "encode", spy)

    async def go() -> None:
        expected = encode("hello", add_special_tokens=False)
        assert await tm.tokenize("hello", add_special_tokens=False) == expected
        await tm.tokenize("hello " * 1000)  # long: in the thread
        release = threading.Event()
        busy = asyncio.get_running_loop().run_in_executor(tm._executor, release.wait)
        short = asyncio.ensure_future(tm.tokenize("hello"))
        await asyncio.sleep(0)  # runs until it waits: behind the blocked call, in the thread
        assert not short.done()
        release.set()
        await busy
        await short

    serving.run(go())
    loop_thread = threading.current_thread().name
    assert threads[0] == loop_thread
    assert threads[1].startswith("tokenize") and threads[2].startswith("tokenize")
