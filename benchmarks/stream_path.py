"""The HTTP process's CPU per streamed token, in-process and without HTTP: a real
TokenizerManager (its sockets bound, nothing behind them) is fed BatchStrOutput as the
detokenizer would send them (NUM_REQS streams, one token each per step), and each stream is
consumed through the route's own SSE body (`OpenAIServingCompletion` or `OpenAIServingChat`:
Updates -> generate_request -> OutputStream -> stream_frames -> frames). One thread does it all,
so the wall time per token is its CPU time. Runs on asyncio's loop and on uvloop in the same
process and prints the ratio; the sockets, uvicorn and the client are not in it.

    .venv/bin/python benchmarks/stream_path.py [--route completions|chat] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace

from sluice.config import ServerArgs
from sluice.messages import BatchStrOutput, FinishReason, ModelInfo
from sluice.server.logprobs import TokenText
from sluice.server.metrics import ServerMetrics
from sluice.server.protocol import ChatCompletionRequest, CompletionRequest
from sluice.server.serving_base import OpenAIServingBase, OutputStream, ServingContext
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.serving_completions import OpenAIServingCompletion
from sluice.tokenizer.generate_input import GenerateReqInput
from sluice.tokenizer.manager import TokenizerManager
from sluice.utils import ipc

NUM_REQS, NUM_TOKENS = 32, 128
WORDS = [" the", " quick", ' "brown"', " fox", "\n", " jumps", " ö", " 你好", " 🙂", "\\"]


def make_manager(addrs: ipc.IpcAddrs) -> TokenizerManager:
    cfg = SimpleNamespace(model_name="bench", vocab_size=1000, multimodal=None, architecture="x")
    info = ModelInfo("bench", "/none", 4096, 1000, max_total_tokens=10**6, max_running_requests=256)
    return TokenizerManager(ServerArgs(), cfg, None, addrs, info)  # type: ignore[arg-type]


def step_output(rids: list[str], step: int) -> BatchStrOutput:
    n = len(rids)
    reason = FinishReason("length") if step == NUM_TOKENS - 1 else None
    return BatchStrOutput(
        rids=rids, texts=[WORDS[(step + i) % len(WORDS)] for i in range(n)],
        new_token_ids=[[step] for _ in range(n)], finished_reasons=[reason] * n,
        prompt_tokens=[8] * n, completion_tokens=[step + 1] * n, cached_tokens=[0] * n,
        output_token_logprobs=[[] for _ in range(n)], output_top_logprobs=[[] for _ in range(n)],
        input_token_logprobs=[[] for _ in range(n)], input_top_logprobs=[[] for _ in range(n)],
    )  # fmt: skip


async def _consume(serving: OpenAIServingBase, state: object, stream: OutputStream) -> int:
    num_frames = 0
    async for _ in serving.sse_body(state, stream):  # type: ignore[arg-type]
        num_frames += 1
    await stream.aclose()
    return num_frames


async def one_round(tm: TokenizerManager, route: str) -> float:
    """Microseconds per token of NUM_REQS streams of NUM_TOKENS tokens."""
    ctx = ServingContext(tm, "bench", ServerMetrics(), TokenText(None))
    is_chat = route == "chat"
    serving = OpenAIServingChat(ctx) if is_chat else OpenAIServingCompletion(ctx)
    consumers, rids = [], []
    for k in range(NUM_REQS):
        if is_chat:
            req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
        else:
            req = CompletionRequest(prompt=[1, 2, 3], stream=True)
        obj = GenerateReqInput(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": NUM_TOKENS}, stream=True,
            rid=f"{route}-{k}-{time.monotonic_ns()}",
        )  # fmt: skip
        state = serving.new_state(req, obj)
        state.extra["echo"] = None
        stream = OutputStream(tm.generate_request(obj, ctx.keepalive_interval))
        consumers.append(asyncio.ensure_future(_consume(serving, state, stream)))
        rids.append(obj.rid)
    for _ in range(5):
        await asyncio.sleep(0)  # every request prepared and "sent"
    start = time.perf_counter()
    for step in range(NUM_TOKENS):
        tm._handle_batch_output(step_output(rids, step))
        for _ in range(4):
            await asyncio.sleep(0)
    frames = await asyncio.gather(*consumers)
    assert all(f >= NUM_TOKENS for f in frames), frames
    return (time.perf_counter() - start) / (NUM_REQS * NUM_TOKENS) * 1e6


async def best_of(route: str, rounds: int) -> float:
    addrs = ipc.IpcAddrs.create(1)
    tm = make_manager(addrs)
    tm.start()
    try:
        await one_round(tm, route)  # warm-up
        return min([await one_round(tm, route) for _ in range(rounds)])
    finally:
        await tm.close()
        addrs.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", choices=["completions", "chat"], default="completions")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import uvloop

    plain = asyncio.run(best_of(args.route, args.rounds))
    fast = uvloop.run(best_of(args.route, args.rounds))
    print(
        f"{args.route}: {NUM_REQS} streams x {NUM_TOKENS} tokens: asyncio loop {plain:.2f} us per "
        f"token, uvloop {fast:.2f} us per token (uvloop / asyncio {fast / plain:.2f})"
    )


if __name__ == "__main__":
    main()
