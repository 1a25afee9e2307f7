"""The scheduler process of a decoder model: the Scheduler driven by `ModelLoop` (loop.py, which
states the loop's guarantees). Each step's outputs go to the detokenizer: the
BatchTokenIDOutput of generation requests, then the BatchEmbeddingOutput of the pooled
(embedding / scoring) requests that finished, which the detokenizer passes on unchanged.
The launcher's STOP_SIGNAL exits 0 (`ipc.exit_on_stop_signal`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
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
    binding = CpuBinding.plan(args)

    def build() -> ModelLoop:
        logger.info(wait_policy)
        core = DecoderCore.load(args)
        loop = ModelLoop.bind(core, addrs, args.health_timeout)
        logger.info(binding.pin(core.info(), core.scheduler.grammars))  # last: after every thread
        return loop

    ipc.run_child(PROCESS_TITLE, args.log_level, ready_conn, build)


# set by the user, these place OpenMP's threads their way: --cpu-bind auto leaves them alone
OMP_PLACEMENT_VARS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")


@dataclass
class CpuBinding:
    """`--cpu-bind`: planned from the arguments (`plan`), carried out once the loop is built
    (`pin`): compute thread i on CPU i of the process's own, the first being the thread that
    runs the scheduler's Python, and the process's other threads on the rest.

    Only with 2 compute threads, where it was measured, and where the pins hold: libgomp ends
    the surplus threads of its pool whenever a region asks for fewer (but more than one) and
    makes new ones later, which would take their creator's one CPU."""

    setting: str
    cpus: list[int] | None  # the process's CPUs, one compute thread each; None: nothing pinned
    reason: str = ""  # why nothing is pinned

    @classmethod
    def plan(cls, args: ServerArgs) -> CpuBinding:
        from sluice.utils import envs
        from sluice.utils.system import available_cpus

        if args.cpu_bind == "off":
            return cls("off", None, "the OS places every thread")
        if not hasattr(os, "sched_setaffinity"):
            return cls("auto", None, "not pinned (not Linux)")
        given = [var for var in OMP_PLACEMENT_VARS if os.environ.get(var)]
        cpus = sorted(os.sched_getaffinity(0))
        threads = args.num_threads or available_cpus()
        why_not = (
            "the model is not on the CPU" if args.device.startswith("cuda")
            else "SLUICE_KERNEL_POOL: its workers are placed by the OS"
            if envs.get_bool("SLUICE_KERNEL_POOL")
            else f"{given[0]} is set" if given
            else f"{threads} compute thread" if threads < 2
            else f"{threads} compute threads on {len(cpus)} CPUs: the OS keeps them clear of "
            "other work" if threads != len(cpus)
            else f"{threads} compute threads: pinned only with 2" if threads > 2
            else None
        )  # fmt: skip
        if why_not is not None:
            return cls("auto", None, f"not pinned ({why_not})")
        return cls("auto", cpus)

    def pin(self, info: ModelInfo, grammars: Any | None) -> str:
        """Pin what the plan says, in the thread that runs the loop; the line to log."""
        import threading

        from sluice.model.kernels import cpu_ops
        from sluice.utils.system import pin_threads

        head = f"--cpu-bind {self.setting}"
        if self.cpus is None:
            return f"{head}: {self.reason}"
        ops = cpu_ops() if info.device == "cpu" else None
        if ops is None:  # nothing to pin the compute threads with, or none on the CPU
            why = "the model is not on the CPU" if info.device != "cpu" else "no CPU kernels"
            return f"{head}: not pinned ({why})"
        # OpenMP's threads, pinned by the kernels, which return their ids
        compute = [threading.get_native_id()]
        try:
            compute = ops.bind_compute_threads(self.cpus[: info.num_threads])
        except RuntimeError as e:  # a smaller team than asked (OMP_DYNAMIC): serve anyway
            logger.warning("--cpu-bind: %s", e)
        spare = pin_threads(compute, self.cpus)
        if grammars is not None:
            grammars.thread_cpus = spare
        return (
            f"{head}: compute threads {compute} on CPUs {self.cpus[: len(compute)]} (the first "
            f"runs the scheduler's Python), the process's other threads on {sorted(spare)}"
        )


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
