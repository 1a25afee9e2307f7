"""The scheduler process of an encoder model: an EncoderScheduler driven by `ModelLoop` (loop.py,
the same loop and guarantees as the decoder's). Each step's BatchEmbeddingOutput goes to
`addrs.detokenizer_in`, which is the detokenizer (it passes it on unchanged) or, for an extra
model of a server, the EmbeddingManager's own socket directly. A generation request is answered
at once with a 400: an encoder cannot generate.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.config import ServerArgs
from sluice.messages import (
    ModelInfo,
    SchedulerHeartbeat,
    TokenizedGenerateReqInput,
)
from sluice.scheduler.loop import ModelLoop, Request, SchedulerCore, abort_output
from sluice.utils import ipc

logger = logging.getLogger(__name__)

PROCESS_TITLE = "sluice::encoder"
CANNOT_GENERATE = "this model is an encoder: it embeds or scores, it cannot generate"


def run_encoder_process(
    args: ServerArgs, addrs: ipc.IpcAddrs, ready_conn: Any, wait_policy: str
) -> None:
    """Entry point of the spawned process: build, report ready (or the error), then loop.
    `wait_policy`: the line that says which OMP_WAIT_POLICY this process runs with."""

    def build() -> ModelLoop:
        logger.info(wait_policy)
        return ModelLoop.bind(EncoderCore.load(args), addrs, args.health_timeout)

    ipc.run_child(PROCESS_TITLE, args.log_level, ready_conn, build)


def encoder_context_len(args: ServerArgs, max_seq_len: int, max_positions: int) -> int:
    if args.context_length > max_positions:
        raise ValueError(
            f"--context-length {args.context_length} exceeds the model's {max_positions} positions"
        )
    return args.context_length or max_seq_len


class EncoderCore(SchedulerCore):
    """The EncoderScheduler as a ModelCore: pooled requests only."""

    @classmethod
    def load(cls, args: ServerArgs) -> EncoderCore:
        import torch

        from sluice.checkpoint.encoder_config import load_encoder_config
        from sluice.model.encoder_runner import EncoderRunner
        from sluice.model.runner import resolve_device, resolve_dtype
        from sluice.scheduler.encoder import EncoderScheduler
        from sluice.utils.system import available_cpus

        assert args.model_path is not None
        cfg = load_encoder_config(args.model_path)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        num_threads = args.num_threads or available_cpus()
        torch.set_num_threads(num_threads)
        context_len = encoder_context_len(args, cfg.max_seq_len, cfg.max_position_embeddings)
        runner = EncoderRunner(cfg, device, dtype)
        max_batch_reqs = args.max_running_requests or 256
        scheduler = EncoderScheduler(
            runner, cfg.vocab_size, context_len, args.max_prefill_tokens, max_batch_reqs,
            waiting_timeout=args.waiting_timeout, running_timeout=args.running_timeout,
        )  # fmt: skip
        info = ModelInfo(
            model_name=cfg.model_name, hf_dir=cfg.hf_dir, context_len=context_len,
            vocab_size=cfg.vocab_size, task="rerank" if cfg.is_cross_encoder else "embed",
            dimensions=runner.output_dim, max_running_requests=max_batch_reqs,
            num_threads=num_threads, device=str(device), dtype=str(dtype).removeprefix("torch."),
        )  # fmt: skip
        return cls(scheduler, info)

    def step(self) -> list[Any]:
        out = self.scheduler.step()
        return [] if out is None else [out]

    def take_request(self, req: Request) -> Any | None:
        if isinstance(req, TokenizedGenerateReqInput):  # answered as generation is: 400
            return abort_output(req, CANNOT_GENERATE, 400)
        self.scheduler.add_request(req)
        return None

    def heartbeat(self) -> SchedulerHeartbeat:
        return SchedulerHeartbeat(0, len(self.scheduler.waiting))
