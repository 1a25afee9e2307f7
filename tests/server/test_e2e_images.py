"""Images through the real server (tiny LLaVA, float32): chat `image_url` parts and /generate's
`image_data` give transformers' greedy tokens for the same inputs (LlavaProcessor's prompt and
pixels); a repeated image is a prefix-cache hit; a bad image is a 400 and the server serves on;
a text-only model refuses images with a 400 that says so."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.server.live_server import LiveServer, assert_no_state_left, running_server
from tests.tiny_models import make_tiny_llava

NUM_TOKENS = 10
SERVER_ARGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--no-embedding-model",
               "--dtype", "float32", "--num-media-workers", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_dir: str) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("e2e_llava"), tokenizer_dir=smollm2_hf_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llava_dir: str) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("e2e_images") / "server.log"
    # loopback URLs allowed: the abort tests fetch from a stalling server of their own
    args = [*SERVER_ARGS, "--allow-private-media-urls"]
    with running_server(llava_dir, args, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(llava_dir: str) -> Any:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


def _image(seed: int, size: tuple[int, int] = (40, 48)) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _data_uri(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _hf_greedy(reference: Any, text: str, images: list[Any]) -> tuple[list[int], int]:
    """transformers' greedy tokens for `text` (placeholders as one image token each) and the
    images, and the prompt's length once the processor expanded it."""
    model, processor = reference
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new) == NUM_TOKENS  # no early stop: the comparison covers every token
    return new, inputs["input_ids"].shape[1]


def _chat(server: LiveServer, messages: list[dict], **extra: Any) -> httpx.Response:
    body = {"messages": messages, "temperature": 0, "max_tokens": NUM_TOKENS,
            "ignore_eos": True, **extra}  # fmt: skip
    return httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=120)


def _template(reference: Any, messages: list[dict]) -> str:
    """The prompt text sluice renders: each image part as `<image>` in its place."""
    _, processor = reference
    flat = []
    for m in messages:
        parts = m["content"] if isinstance(m["content"], list) else [m["content"]]
        texts = [p if isinstance(p, str) else p.get("text", "<image>") for p in parts]
        flat.append({"role": m["role"], "content": "\n".join(texts)})
    return processor.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)


def _image_part(image: Any) -> dict:
    return {"type": "image_url", "image_url": {"url": _data_uri(image)}}


@pytest.mark.parametrize(
    "layout",
    [["<0>", "What is in the picture?"], ["Compare", "<1>", "with", "<2>", "briefly."]],
    ids=["one-image", "two-images"],
)
def test_chat_with_images_equals_transformers(server, reference, layout) -> None:
    images = {f"<{k}>": _image(k, (40 + 8 * k, 48)) for k in range(3)}
    content = [_image_part(images[p]) if p in images else {"type": "text", "text": p}
               for p in layout]  # fmt: skip
    messages = [{"role": "user", "content": content}]
    resp = _chat(server, messages)
    assert resp.status_code == 200, resp.text
    used = [images[p] for p in layout if p in images]
    want, prompt_len = _hf_greedy(reference, _template(reference, messages), used)
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == prompt_len
    tokenizer = reference[1].tokenizer
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(
        want, skip_special_tokens=True
    )


def test_generate_with_image_data_equals_transformers(server, reference) -> None:
    text = "USER: <image>\nand this one: <image> ASSISTANT:"
    images = [_image(5), _image(6, (64, 40))]
    body = {"text": text, "image_data": [_data_uri(i) for i in images],
            "sampling_params": {"temperature": 0, "max_new_tokens": NUM_TOKENS,
                                "ignore_eos": True}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    want, prompt_len = _hf_greedy(reference, text, images)
    assert resp.json()["output_ids"] == want
    assert resp.json()["meta_info"]["prompt_tokens"] == prompt_len


def test_a_repeated_image_hits_the_prefix_cache(server) -> None:
    messages = [
        {"role": "user", "content": [_image_part(_image(7)), {"type": "text", "text": "Hm?"}]}
    ]
    first, second = _chat(server, messages), _chat(server, messages)
    assert first.status_code == second.status_code == 200, first.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt_len = second.json()["usage"]["prompt_tokens"]
    assert prompt_len > 16 and cached >= 16  # at least the image's positions came cached
    assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    other = [{"role": "user", "content": [_image_part(_image(8)), {"type": "text", "text": "Hm?"}]}]
    fresh = _chat(server, other).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert fresh < cached  # another image: its positions are not confused with the first's


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("ftp://example.com/a.png", "not supported"),
    ],
)
def test_a_bad_image_is_a_400_and_the_server_serves_on(server, url, says) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    resp = _chat(server, messages)
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["error"]["message"]
    ok = _chat(server, [{"role": "user", "content": [_image_part(_image(9))]}])
    assert ok.status_code == 200, ok.text


def test_placeholders_must_match_the_images(server) -> None:
    body = {"text": "<image> <image>", "image_data": _data_uri(_image(1)),
            "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=body, timeout=60)
    assert resp.status_code == 400 and "2 image placeholders for 1 images" in resp.text
    turn = {"text": "<image>", "image_data": _data_uri(_image(1)),
            "session_params": {"id": "no-such-session"}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=turn, timeout=60)
    assert resp.status_code == 400 and "images in session turns" in resp.text


@contextlib.contextmanager
def stalling_image_server() -> Iterator[tuple[str, threading.Event]]:
    """An HTTP server on loopback that accepts connections and never answers: the URL, and an
    event set once a connection came in."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    connected = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(sock.accept()[0])
                connected.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/slow.png", connected
    finally:
        sock.close()
        for conn in held:
            conn.close()


def test_abort_while_the_image_is_fetched(server) -> None:
    """/abort_request ends a request whose image is still being fetched at once (not at the
    fetch timeout), with an abort finish, and nothing of it is left behind."""
    with stalling_image_server() as (url, connected):
        body = {"text": "<image> hi", "image_data": url, "rid": "stalled-fetch",
                "sampling_params": {"max_new_tokens": 4}}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            pending = pool.submit(httpx.post, f"{server.base}/generate", json=body, timeout=60)
            assert connected.wait(30), "the server never fetched the image"
            abort = httpx.post(f"{server.base}/abort_request", json={"rid": "stalled-fetch"})
            assert abort.status_code == 200, abort.text
            resp = pending.result(timeout=30)
            took = time.monotonic() - start
    assert took < 8, f"the abort waited for the fetch ({took:.1f} s)"
    assert resp.json()["meta_info"]["finish_reason"]["type"] == "abort", resp.text
    assert_no_state_left(server.wait_idle())


def test_a_client_gone_while_the_image_is_fetched_leaves_nothing(server) -> None:
    with stalling_image_server() as (url, connected):
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 4}  # fmt: skip
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=2)
        assert connected.is_set()
        assert_no_state_left(server.wait_idle())
    assert _chat(server, [{"role": "user", "content": [_image_part(_image(3))]}]).status_code == 200


def test_prompt_logprobs_pair_image_positions_with_the_image_token(server, reference) -> None:
    body = {"text": "A <image> B", "image_data": _data_uri(_image(4)), "return_logprob": True,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    resp = httpx.post(f"{server.base}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    pairs = resp.json()["meta_info"]["input_token_logprobs"]
    image_token_id = reference[0].config.image_token_id
    at_image = [p for p in pairs if p[1] == image_token_id]
    assert len(pairs) == resp.json()["meta_info"]["prompt_tokens"] and len(at_image) == 16
    assert all(lp is None for lp, _ in at_image)
    assert all(isinstance(lp, float) for lp, t in pairs[1:] if t != image_token_id)


def test_a_storm_of_bad_images_among_good_ones(server) -> None:
    """Bad images (undecodable, not base64, too many) mixed with good ones, all at once: each
    bad one a 400, each good one a 200, and the server idle after."""
    good = {"role": "user", "content": [_image_part(_image(10)), {"type": "text", "text": "?"}]}
    bad_parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,###"}},
    ]
    bodies = []
    for k in range(24):
        if k % 3 == 0:
            bodies.append(([good], 200))
        elif k % 3 == 1:
            bodies.append(([{"role": "user", "content": [bad_parts[k % 2]]}], 400))
        else:
            many = [_image_part(_image(12))] * 17  # over --max-images-per-request (16)
            bodies.append(([{"role": "user", "content": many}], 400))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda b: _chat(server, b[0]).status_code, bodies))
    assert codes == [want for _, want in bodies]
    assert_no_state_left(server.wait_idle())


def test_no_state_left_behind(server) -> None:
    assert_no_state_left(server.wait_idle())


def test_images_to_a_text_only_model_are_a_400(tmp_path_factory, tiny_llama_dir) -> None:
    log = tmp_path_factory.mktemp("e2e_text_only") / "server.log"
    with running_server(tiny_llama_dir, SERVER_ARGS, log) as srv:
        part = {"type": "image_url", "image_url": {"url": _data_uri(_image(0))}}
        resp = _chat(srv, [{"role": "user", "content": [part]}])
        assert resp.status_code == 400 and "accepts text only" in resp.json()["error"]["message"]
        body = {"text": "hi", "image_data": _data_uri(_image(0))}
        resp = httpx.post(f"{srv.base}/generate", json=body, timeout=60)
        assert resp.status_code == 400 and "accepts text only" in resp.json()["error"]["message"]
        assert _chat(srv, [{"role": "user", "content": "hello"}]).status_code == 200
        assert_no_state_left(srv.wait_idle())
