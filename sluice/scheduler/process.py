"""The scheduler process of a decoder model: the Scheduler driven by `ModelLoop` (loop.py, which
states the loop's guarantees). Each step's outputs go to the detokenizer: the
BatchTokenIDOutput of generation requests, then the BatchEmbeddingOutput of the pooled
(embedding / scoring) requests that finished, which the detokenizer passes on unchanged.
The launcher's STOP_SIGNAL exits 0 (`ipc.exit_on_stop_signal`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sluice.config import ServerArgs
from sluice.messages import (
    CloseSessionReq,
    ModelInfo,
    OpenSessionReq,
    SchedulerHeartbeat,
    TokenizedEmbeddingReqInput,
)
from sluice.scheduler.loop import ModelLoop, Request, SchedulerCore
from sluice.utils import ipc

logger = logging.getLogger(__name__)

PROCESS_TITLE = "sluice::scheduler"


def run_scheduler_process(args: ServerArgs, addrs: ipc.IpcAddrs, ready_conn: Any) -> None:
    """Entry point of the spawned process: build, report ready (or the error), then loop.
    An encoder model (embeddings, cross-encoder) gets the EncoderScheduler's core instead."""
    from sluice.checkpoint.encoder_config import is_encoder_model

    if is_encoder_model(args.model_path):
        from sluice.scheduler.encoder_process import run_encoder_process

        wait_policy = set_omp_wait_policy(args, kernel_pool=False)
        return run_encoder_process(args, addrs, ready_conn, wait_policy)
    wait_policy = set_omp_wait_policy(args, kernel_pool=True)

    def build() -> ModelLoop:
        logger.info(wait_policy)
        loop = ModelLoop.bind(DecoderCore.load(args), addrs, args.health_timeout)
        logger.info(bind_cpus(args, loop.info()))  # last: every thread made so far is placed
        return loop

    ipc.run_child(PROCESS_TITLE, args.log_level, ready_conn, build)


def bind_cpus(args: ServerArgs, info: ModelInfo) -> str:
    """Pin the scheduler's threads as `--cpu-bind` says (`system.pin_threads`); the line to log.
    Runs once the model is loaded and the sockets are open, in the thread that runs the loop."""
    import torch

    from sluice.model.kernels import cpu_ops
    from sluice.utils import envs
    from sluice.utils.system import pin_threads

    head = f"--cpu-bind {args.cpu_bind}"
    if args.cpu_bind == "off":
        return f"{head}: the OS places every thread"
    if not hasattr(os, "sched_setaffinity"):
        return f"{head}: not pinned (not Linux)"
    n, cpus = torch.get_num_threads(), len(os.sched_getaffinity(0))
    ops = cpu_ops() if info.device == "cpu" else None
    why_not = (
        "the model is not on the CPU" if info.device != "cpu"
        else "SLUICE_KERNEL_POOL: its workers are placed by the OS"
        if envs.get_bool("SLUICE_KERNEL_POOL")
        else "sluice's CPU kernels are not built" if ops is None
        else f"{n} compute thread" if n < 2
        else f"{n} compute threads and {cpus} CPUs" if cpus < n
        else None
    )  # fmt: skip
    if why_not is not None:
        return f"{head}: not pinned ({why_not})"
    return f"{head}: {pin_threads(ops.bind_compute_threads, n)}"


def set_omp_wait_policy(args: ServerArgs, kernel_pool: bool) -> str:
    """Set this process's OMP_WAIT_POLICY (`--omp-wait-policy`); the line to log. Runs before
    torch is imported: libgomp reads the variable once, when it loads. Under `auto` a process
    whose CPU kernels take sluice's pool (`kernel_pool`: a decoder's, with SLUICE_KERNEL_POOL=1)
    sleeps at once, so that torch's own threads do not spin beside the pool's workers, unless
    OMP_WAIT_POLICY is given."""
    from sluice.utils import envs
    from sluice.utils.system import omp_wait_policy

    given = envs.get_str("OMP_WAIT_POLICY")
    policy = omp_wait_policy(args.omp_wait_policy)
    if policy is None and not given and kernel_pool and envs.get_bool("SLUICE_KERNEL_POOL"):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        return "--omp-wait-policy auto: passive (SLUICE_KERNEL_POOL: the kernels take the pool)"
    if policy is None:
        kept = f"OMP_WAIT_POLICY={given} from the environment" if given else "OpenMP's default"
        return f"--omp-wait-policy {args.omp_wait_policy}: {kept}"
    os.environ["OMP_WAIT_POLICY"] = policy
    return f"--omp-wait-policy {args.omp_wait_policy}: {policy.lower()}"


class DecoderCore(SchedulerCore):
    """The decoder's Scheduler as a ModelCore: generation and pooled requests, sessions."""

    @classmethod
    def load(cls, args: ServerArgs) -> DecoderCore:
        import torch

        from sluice.checkpoint.hf_dir import load_model_config
        from sluice.scheduler.resources import resolve_resources
        from sluice.scheduler.scheduler import Scheduler
        from sluice.utils.tokenizer import get_tokenizer

        cfg = load_model_config(args.model_path)
        res = resolve_resources(args, cfg)
        torch.set_num_threads(res.num_threads)
        info = ModelInfo(
            model_name=cfg.model_name, hf_dir=cfg.hf_dir, context_len=res.context_len,
            vocab_size=cfg.vocab_size, dimensions=cfg.hidden_size,
            max_total_tokens=res.max_total_tokens, max_running_requests=res.max_running_requests,
            num_threads=res.num_threads, device=str(res.device),
            dtype=str(res.dtype).removeprefix("torch."),
        )  # fmt: skip
        return cls(Scheduler(args, cfg, get_tokenizer(cfg.hf_dir), res), info)

    def step(self) -> list[Any]:
        outs = (self.scheduler.step(), self.scheduler.take_embedding_output())
        return [out for out in outs if out is not None]

    def take_request(self, req: Request) -> None:
        if isinstance(req, TokenizedEmbeddingReqInput):
            self.scheduler.add_embedding_request(req)
        else:
            self.scheduler.add_request(req)

    def handle_own(self, msg: Any) -> Any | None:
        match msg:
            case OpenSessionReq():
                return self.scheduler.open_session(msg)
            case CloseSessionReq():
                self.scheduler.close_session(msg)
                return None
        return super().handle_own(msg)

    def heartbeat(self) -> SchedulerHeartbeat:
        s = self.scheduler
        return SchedulerHeartbeat(len(s.running) + (s.chunked_req is not None), len(s.waiting))

    def tick(self) -> None:
        self.scheduler.expire_sessions()  # about once a second, busy or idle
