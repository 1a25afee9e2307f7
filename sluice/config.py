"""ServerArgs: every setting of sluice, in one frozen dataclass.

argparse is built from the dataclass fields (their defaults and `help` metadata), so a setting is
declared once. "auto" values (0 or "auto") are resolved once at start-up, in the process that
uses them (`scheduler/resources.py`, `model/runner.py`'s `resolve_dtype`), which logs each value.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A setting: its default, its --help text, and optionally `choices`, `pattern` (a regular
    expression the whole value must match), and `at_least`, `above`, `at_most` (bounds of a
    number). ServerArgs checks them whether a value comes from the command line or from
    Engine(**kwargs)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = _opt(
        None, "Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)"
    )
    served_model_name: str | None = _opt(None, "model id reported by the API (default: derived)")
    embedding_model_path: str | None = _opt(
        "auto",
        "embedding model served next to --model-path, routed by the `model` field (a BERT "
        "sentence-transformers directory; auto: all-MiniLM-L6-v2 when installed; none: no)",
    )
    no_embedding_model: bool = _opt(False, "no embedding model (as --embedding-model-path none)")
    rerank_model_path: str | None = _opt(
        None, "cross-encoder (BertForSequenceClassification directory) served for /v1/rerank"
    )
    context_length: int = _opt(
        0, "maximum tokens per request, prompt plus output (0: model's)", at_least=0
    )
    dtype: str = _opt(
        "auto",
        "weights and KV dtype (auto: bfloat16 on CUDA and on CPUs with native bfloat16, AMX-BF16 "
        "or AVX512-BF16; float32 on other CPUs; README.md says what each costs)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )  # fmt: skip
    quantization: str = _opt(
        "auto",
        "weights of a GGUF file: gguf keeps their Q8_0/Q4_0/Q4_1 blocks, computed by sluice's "
        "CPU kernels; none dequantizes them to --dtype; auto: gguf for a GGUF on the CPU when "
        "the kernels build, else none. int8 / int4 quantize any checkpoint's linear layers at "
        "load, per group of 32 values, into Q8_0 / Q4_1 blocks for the same kernels (CPU only)",
        choices=["auto", "gguf", "none", "int8", "int4"],
    )  # fmt: skip
    device: str = _opt(
        "auto",
        "where the model runs: auto (cuda when available), cpu, cuda or cuda:N",
        pattern=r"auto|cpu|cuda(:\d+)?",
    )
    num_threads: int = _opt(
        0, "compute threads of the scheduler (0: the cores available)", at_least=0
    )
    omp_wait_policy: str = _opt(
        "auto",
        "how the scheduler's idle OpenMP threads wait: active (spin without end: the HTTP and "
        "detokenizer processes then wait for a core), passive (sleep at once: every parallel "
        "region wakes its threads); auto: OpenMP's default (spin a while, then sleep), passive "
        "for a generative model whose kernels take sluice's pool (SLUICE_KERNEL_POOL=1), or "
        "OMP_WAIT_POLICY from the environment. On 2 cores auto was fastest (README)",
        choices=["auto", "active", "passive"],
    )
    cpu_bind: str = _opt(
        "auto",
        "pin the scheduler's compute threads one to a CPU, and its other threads (sockets, "
        "grammar workers) off the CPU of the first, which runs the scheduler's Python: on 2 "
        "cores, decode-heavy 1.04-1.05x (README). auto: on Linux, for a generative model on the "
        "CPU, with 2 compute threads that have the process's 2 CPUs to themselves, unless "
        "SLUICE_KERNEL_POOL or OMP_PLACES / OMP_PROC_BIND / GOMP_CPU_AFFINITY is set; off: the "
        "OS places every thread",
        choices=["auto", "off"],
    )
    random_seed: int = _opt(0, "seed for requests that do not give one")

    # memory
    max_total_tokens: int = _opt(
        0, "size of the KV pool in tokens (0: from --mem-fraction)", at_least=0
    )
    mem_fraction: float = _opt(
        0.25,
        "fraction of free memory given to the KV pool (on the CPU the pool's memory is taken as "
        "it fills, not at start: servers started side by side each see all of the free memory)",
        above=0.0,
        at_most=1.0,
    )
    max_running_requests: int = _opt(
        0, "concurrent requests in the running batch (0: auto)", at_least=0
    )
    disable_radix_cache: bool = _opt(False, "turn off prefix reuse through the radix cache")

    # scheduling
    max_prefill_tokens: int = _opt(
        4096,
        "prompt tokens prefilled in one step, all requests together (with chunking on, also at "
        "most --chunked-prefill-size); without chunking a longer prompt runs alone in its step",
        at_least=1,
    )  # fmt: skip
    # 2048 rather than 1024: on a 2-core AMX Xeon (lscpu model 167), 32 prompts of 150 tokens
    # arriving together ran 1.07x more output tok/s (paired, 6 rounds; 4096: 1.08x), as oneDNN's
    # bfloat16 GEMM uses two threads well only from about 2048 rows; a step of a long prompt's
    # chunk (which the running batch decodes beside) holds twice the tokens it did at 1024
    chunked_prefill_size: int = _opt(
        2048,
        "longest prefill chunk of one request: longer prompts are prefilled over several steps, "
        "between decode steps of the running batch (0: no chunking)",
        at_least=0,
    )  # fmt: skip
    disable_mixed_prefill: bool = _opt(
        False,
        "run prefills in steps of their own; by default, on the CPU, the running batch decodes "
        "in the same forward as a prefill (one pass over the weights, no decode stall while "
        "prompts arrive)",
    )  # fmt: skip
    schedule_policy: str = _opt(
        "fcfs", "fcfs: arrival order; lpm: longest cached prefix first", choices=["fcfs", "lpm"]
    )
    check_invariants: bool = _opt(False, "check the KV pool invariant whenever the scheduler idles")
    waiting_timeout: float = _opt(
        0.0, "seconds a request may wait before it is scheduled (0: off)", at_least=0
    )
    running_timeout: float = _opt(0.0, "seconds a request may take in all (0: off)", at_least=0)
    max_queued_requests: int = _opt(
        0,
        "requests in flight beyond --max-running-requests before new ones get 429 (0: no limit)",
        at_least=0,
    )
    grammar_backend: str = _opt(
        "llguidance",
        "engine for json_schema / regex / ebnf constraints and forced tool calls (none: such "
        "requests get 400)",
        choices=["llguidance", "none"],
    )
    grammar_compile_timeout: float = _opt(
        10.0,
        "seconds a grammar may take to compile; past it the request gets 400 and the same "
        "grammar fails at once afterwards",
        above=0,
    )
    tool_call_parser: str = _opt(
        "auto",
        "format of the chat model's tool calls (auto: the one its chat template teaches; "
        "templates without tools get a prompt asking for hermes-style <tool_call> blocks)",
        choices=["auto", "hermes", "llama3", "mistral"],
    )
    reasoning_parser: str | None = _opt(
        None,
        "split the chat model's <think>...</think> reasoning into reasoning_content "
        "(deepseek-r1: the template opens it; qwen3: the model does, unless enable_thinking "
        "is false)",
        choices=[None, "deepseek-r1", "qwen3"],
    )

    # serving
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(30000, "port to listen on", at_least=1, at_most=65535)
    api_key: str | None = _opt(None, "require this key as a Bearer token")
    stream_interval: int = _opt(1, "tokens per streamed update", at_least=1)
    log_level: str = _opt(
        "info", "debug | info | warning | error", choices=["debug", "info", "warning", "error"]
    )
    shutdown_timeout: float = _opt(
        20.0, "on SIGTERM, seconds to let requests in flight finish before aborting them",
        at_least=0,
    )  # fmt: skip
    tokenizer_worker_num: int = _opt(
        1,
        "HTTP worker processes sharing --port (SO_REUSEPORT), each with its own TokenizerManager, "
        "in front of one scheduler and one detokenizer; a worker that dies stops the server",
        at_least=1,
    )
    health_timeout: float = _opt(
        20.0, "/health_generate is 503 when the scheduler was silent for this many seconds",
        above=0,
    )  # fmt: skip

    # images (vision-language models; a text-only model refuses them)
    allowed_media_domains: tuple[str, ...] = _opt(
        (),
        "hosts image URLs may be fetched from, each with its subdomains (example.com allows "
        "cdn.example.com; default: any public host)",
    )
    allowed_local_media_path: str | None = _opt(
        None,
        "directory whose files requests may name as file:// image URLs (symlinks and .. must "
        "stay inside it; default: local files refused)",
    )
    allow_private_media_urls: bool = _opt(
        False,
        "let image URLs reach loopback, private (RFC 1918, fc00::/7) and carrier-grade NAT "
        "addresses, for intranet deployments; link-local, cloud metadata, multicast and "
        "reserved addresses stay refused",
    )
    media_fetch_timeout: float = _opt(
        10.0, "seconds one image fetch may take, redirects and body included", above=0
    )
    max_media_redirects: int = _opt(5, "redirects followed per image fetch", at_least=0)
    max_image_bytes: int = _opt(
        20 * 1024 * 1024, "bytes per image, fetched or in a data: URI", at_least=1
    )
    max_image_pixels: int = _opt(
        25_000_000, "width x height per image, checked before decoding", at_least=1
    )
    max_images_per_request: int = _opt(16, "images in one request", at_least=0)
    max_image_tiles_per_request: int = _opt(
        128,
        "tiles of all the images of one request, as the image processor cut them (a LLaVA "
        "image is one tile; an Idefics3 / SmolVLM image a grid of tiles and the global image)",
        at_least=1,
    )
    media_cache_mb: int = _opt(
        256, "MiB of decoded (or processed) images kept by content hash (0: no cache)", at_least=0
    )
    image_feature_cache_mb: int = _opt(
        256,
        "MiB of vision-tower outputs kept by image hash in the scheduler, so a repeated image "
        "or a later prefill chunk of it skips the tower (0: no cache)",
        at_least=0,
    )
    num_media_workers: int = _opt(
        0, "processes decoding and processing images, started at the first image (0: cores, at most 4)",
        at_least=0,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type == "tuple[str, ...]":  # a list from Engine(**kwargs), a,b from a string
                value = getattr(self, f.name)
                if isinstance(value, str):
                    value = [v.strip() for v in value.split(",") if v.strip()]
                object.__setattr__(self, f.name, tuple(value))
        for f in dataclasses.fields(self):
            problem = _out_of_range(getattr(self, f.name), f.metadata)
            if problem:
                raise ValueError(f"{f.name} (--{f.name.replace('_', '-')}) {problem}")

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def _out_of_range(value: Any, rules: Any) -> str | None:
    """What is wrong with `value` under a field's `choices`/`at_least`/`above`/`at_most`."""
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        return f"must be one of {', '.join(choices)}; got {value!r}"
    if "pattern" in rules and not re.fullmatch(rules["pattern"], str(value)):
        return f"must match {rules['pattern']}; got {value!r}"
    bounded = any(key in rules for key in ("at_least", "above", "at_most"))
    if bounded and isinstance(value, float) and math.isnan(value):
        return "must be a number; got nan"
    if "at_least" in rules and value < rules["at_least"]:
        return f"must be at least {rules['at_least']}; got {value}"
    if "above" in rules and value <= rules["above"]:
        return f"must be more than {rules['above']}; got {value}"
    if "at_most" in rules and value > rules["at_most"]:
        return f"must be at most {rules['at_most']}; got {value}"
    return None


def build_parser(prog: str = "sluice serve") -> argparse.ArgumentParser:
    from sluice.utils import envs

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a language model behind an OpenAI-compatible HTTP API.",
        epilog="example:\n  sluice serve --model-path ./my-model --port 8000 --max-total-tokens "
        f"65536\n\nenvironment variables:\n{envs.describe()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"]
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=text)
            continue
        if f.type == "tuple[str, ...]":
            parser.add_argument(flag, nargs="+", default=f.default, metavar="VALUE", help=text)
            continue
        if f.default is not None and "default" not in text:
            text = f"{text} (default: {f.default})"
        kind = {"int": int, "float": float}.get(str(f.type), str)
        choices = f.metadata.get("choices")
        if choices is not None:  # None (unset) is a default, not something to type
            choices = [c for c in choices if c is not None]
        parser.add_argument(flag, type=kind, default=f.default, help=text, choices=choices)
    return parser


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
