"""Images benchmark: one-image chats through sluice's server, on the tiny LLaVA-style model the
tests build (a 2-layer CLIP tower on 32x32 images, 16 image positions, a 2-layer Llama with
SmolLM2's tokenizer), or on `--model DIR`.

Every request is a streamed `/v1/chat/completions` with one image (a `data:` URI of a W x H JPEG,
`--image-size`, default 1600x1200, the size of a phone photo) and a short question, greedy,
`max_tokens` 8, `ignore_eos`; every body is JSON-encoded before its clock starts. In one
server, in this order:

  text      C concurrent clients (closed loop) send text-only chats, before any image: the
            media pool is not started (its processes are counted);
  new       C concurrent clients, every request a new image: images/s and TTFT p50/p99;
  repeat    one client: a new image, then the same request again, K times; the repeat is served
            from the caches (decoded-and-processed image, radix prefix, vision features). TTFT
            p50 of each and new / repeat (target >= 5);
  text'     `text` again, with the media pool started and idle: text' / text is what the pool
            costs text-only traffic (target: nothing, ~1.00).

    .venv/bin/python benchmarks/images.py [--num-requests 64] [--concurrency 8] [--repeats 16]
        [--image-size 1600x1200] [--model DIR] [--sluice-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from serving import (  # noqa: E402
    RequestStats,
    ServerProcess,
    client_session,
    drive,
    free_port,
    percentile,
    sluice_command,
    stream_request,
)
from structured_output import cpu_model, wait_for_quiet  # noqa: E402

MAX_TOKENS = 8
QUESTIONS = ("What is in this picture?", "Describe the image.", "Which colours do you see?")


# ---------------------------------------------------------------- requests


def jpeg_data_uri(seed: int, width: int, height: int) -> str:
    """A photo-like JPEG: smooth colour fields with some grain (so it compresses like a photo,
    ~100-300 KB at 1600x1200), different for every seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        (fx, fy), phase = rng.uniform(0.5, 6, 2) / max(width, height), rng.uniform(0, 6.3)
        channels.append(127 + 100 * np.sin(2 * np.pi * (fx * x + fy * y) + phase))
    pixels = np.stack(channels, axis=-1) + rng.normal(0, 6, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_payload(question: str, image: str | None) -> bytes:
    """The request's JSON body, encoded here, before any clock starts: a client's encoding of a
    ~400 KB body (1 to 2 ms in Python) is the client's time, not the server's."""
    content: list[dict] = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return json.dumps({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip


@dataclass
class Run:
    stats: list[RequestStats]
    errors: list[str]
    elapsed: float

    @property
    def req_s(self) -> float:
        return len(self.stats) / self.elapsed

    def ttft_ms(self, q: float) -> float:
        return percentile([s.ttft for s in self.stats], q) * 1000


def run_load(url: str, payloads: list[bytes], concurrency: int) -> Run:
    stats, errors, elapsed = asyncio.run(drive(url, payloads, concurrency))
    return Run([s for s in stats if s is not None], errors, elapsed)


async def _pairs(url: str, images: list[str]) -> tuple[list[float], list[float]]:
    """TTFT of each image's first request and of the same request right after it."""
    new, hit = [], []
    async with client_session() as client:
        for k, image in enumerate(images):
            payload = chat_payload(QUESTIONS[k % len(QUESTIONS)], image)
            new.append((await stream_request(client, url, payload)).ttft)
            hit.append((await stream_request(client, url, payload)).ttft)
    return new, hit


# ---------------------------------------------------------------- processes


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64, help="requests of `new` and `text`")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=16, help="new/repeat pairs of `repeat`")
    p.add_argument("--image-size", default="1600x1200", help="W x H of every image")
    p.add_argument("--model", default=None, help="a vision-language checkpoint (default: tiny)")
    p.add_argument(
        "--tower", default="32/8",
        help="IMAGE_SIZE/PATCH of the tiny model's CLIP tower: 32/8 (the tests', 16 image "
        "positions) or e.g. 224/14 (a ViT-B/14 geometry, 256 positions; the tiny text model takes 512)",
    )  # fmt: skip
    p.add_argument("--sluice-args", default="", help="more `sluice serve` flags")
    p.add_argument("--max-load", type=float, default=0.5)
    return p.parse_args()


def tiny_llava(out: str, tower: str = "32/8") -> str:
    from sluice.checkpoint.hf_dir import default_model_path, prepare_hf_dir
    from tests.tiny_models import make_tiny_llava

    size, patch = (int(v) for v in tower.split("/"))
    return make_tiny_llava(
        out, tokenizer_dir=prepare_hf_dir(default_model_path()),
        vision_overrides={"image_size": size, "patch_size": patch},
    )  # fmt: skip


def print_run(name: str, run: Run, unit: str) -> None:
    print(
        f"{name:<8} {run.req_s:8.2f} {unit}/s  TTFT p50 {run.ttft_ms(50):7.1f} ms  "
        f"p99 {run.ttft_ms(99):7.1f} ms  ({len(run.stats)} done, {len(run.errors)} failed)"
    )
    for error in run.errors[:3]:
        print(f"    error: {error[:200]}")


def main() -> None:
    args = parse_args()
    width, height = (int(v) for v in args.image_size.lower().split("x"))
    n, c = args.num_requests, args.concurrency
    load = wait_for_quiet(args.max_load, tries=6)
    print(f"machine: {cpu_model()}, load average {load:.2f} at start")
    with tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        model = args.model or tiny_llava(tmp, args.tower)
        tower = "" if args.model else f" (tiny LLaVA, CLIP tower {args.tower})"
        print(f"model: {model}{tower}; images {width}x{height} JPEG; {MAX_TOKENS} output tokens")
        images = [jpeg_data_uri(seed, width, height) for seed in range(n + args.repeats + 2)]
        kb = np.mean([len(i) * 3 / 4 / 1024 for i in images])
        print(f"{len(images)} images made, {kb:.0f} KB each on average")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = sluice_command(port, ["--model-path", model, *shlex.split(args.sluice_args)])
        with ServerProcess("sluice-server", cmd, base, "/health") as server:
            url = base + "/v1/chat/completions"
            before = len(descendants(server.proc.pid))
            text_payloads = [chat_payload(QUESTIONS[i % 3] + f" ({i})", None) for i in range(n)]
            run_load(url, text_payloads[: 4 * c], c)  # warm up the text path
            text = run_load(url, text_payloads, c)
            text_procs = len(descendants(server.proc.pid))
            warm = [chat_payload(QUESTIONS[0], image) for image in images[-2:]]
            run_load(url, warm * 2, 2)  # start the pool, warm the image path
            new = run_load(url, [chat_payload(QUESTIONS[i % 3], images[i]) for i in range(n)], c)
            fresh, repeated = asyncio.run(_pairs(url, images[n : n + args.repeats]))
            image_procs = len(descendants(server.proc.pid))
            text_again = run_load(url, text_payloads, c)
    print(f"\n{c} concurrent clients, {n} requests per load run:")
    print_run("text", text, "req")
    print_run("new", new, "images")
    print_run("text'", text_again, "req")
    p50_new, p50_hit = percentile(fresh, 50) * 1000, percentile(repeated, 50) * 1000
    print(
        f"repeat   one client, {args.repeats} pairs: TTFT p50 new image {p50_new:.1f} ms, "
        f"repeated {p50_hit:.1f} ms: new / repeated {p50_new / p50_hit:.2f}x (target >= 5)"
    )
    print(
        f"text' / text: {text_again.req_s / text.req_s:.2f}x req/s, TTFT p50 "
        f"{text_again.ttft_ms(50) / text.ttft_ms(50):.2f}x (target: ~1.00)"
    )
    print(
        f"server processes: {before} at start, {text_procs} after text-only traffic, "
        f"{image_procs} after images (the difference: media workers)"
    )


if __name__ == "__main__":
    main()
