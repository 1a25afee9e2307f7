"""Process plumbing: the CLI, start-up failures, the watchdog, and stopping without orphans.

The server tests run the real `python -m sluice serve` and look at its process tree with psutil.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import psutil
import pytest

from sluice.config import ServerArgs
from sluice.launch import ServingProcesses
from sluice.messages import (
    AbortReq,
    BatchTokenizedGenerateReqInput,
    FlushCacheReply,
    ModelInfo,
    ReadyMsg,
    SamplingParams,
    ToDetokenizer,
    ToHttp,
    TokenizedGenerateReqInput,
    ToScheduler,
)
from sluice.tokenizer.generate_input import GenerateReqInput
from sluice.tokenizer.manager import RequestError
from sluice.utils import ipc

SERVE = [sys.executable, "-m", "sluice", "serve"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ---- framing --------------------------------------------------------------------------------


def test_messages_roundtrip_typed_and_malformed_frames_are_rejected() -> None:
    req = TokenizedGenerateReqInput(
        rid="r", input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4, stop=["x"])
    )
    batch = BatchTokenizedGenerateReqInput([req, req])
    to_scheduler = ipc.Inbox(ToScheduler)
    for msg, inbox in (
        (req, to_scheduler),
        (batch, to_scheduler),
        (AbortReq(rid="r"), to_scheduler),
        (AbortReq(rid="r"), ipc.Inbox(ToDetokenizer)),
        (ReadyMsg("scheduler", info=ModelInfo("m", "/d", 8, 16)), ipc.Inbox(ReadyMsg)),
    ):
        data = ipc.encode(msg)
        assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__
        assert inbox.decode(data) == msg
    nope = msgspec.msgpack.encode({"type": "Nope"})
    for data in (b"", nope, b"\xc1", ipc.encode(FlushCacheReply(True))):
        with pytest.raises(ValueError):
            to_scheduler.decode(data)  # a reply is not a message the scheduler takes
    with pytest.raises(ValueError):
        ipc.Inbox(ToHttp).decode(ipc.encode(AbortReq(rid="r")))
    with pytest.raises(TypeError):
        ipc.encode(ServerArgs())  # type: ignore[arg-type]


# ---- command line -------------------------------------------------------------------------


def test_help_lists_the_command_and_its_options() -> None:
    top = _run([sys.executable, "-m", "sluice", "--help"])
    assert top.returncode == 0 and "serve" in top.stdout
    serve = _run([*SERVE, "--help"])
    assert serve.returncode == 0
    for option in ("--model-path", "--max-total-tokens", "--port", "--context-length"):
        assert option in serve.stdout
    # every environment variable sluice reads, with its default
    assert "environment variables:" in serve.stdout
    for name in ("SLUICE_CACHE_DIR", "SLUICE_CPU_KERNELS", "SLUICE_CUDA_SDPA"):
        assert f"{name} (default " in serve.stdout
    assert _run([sys.executable, "-m", "sluice"]).returncode == 2


def test_missing_model_exits_with_a_message() -> None:
    res = _run([*SERVE, "--model-path", "/nonexistent/model", "--port", str(_free_port())])
    assert res.returncode == 1
    assert "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_busy_port_fails_before_loading_the_model() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = _run([*SERVE, "--port", str(busy.getsockname()[1])], timeout=30)
    assert res.returncode == 1 and "cannot listen on 127.0.0.1" in res.stderr
    assert "sluice::scheduler" not in res.stderr  # no child was started


def test_child_start_failure_reports_its_traceback(tiny_llama_dir: str) -> None:
    # a context longer than the model's 512 positions is refused inside the scheduler process
    cmd = [*SERVE, "--model-path", tiny_llama_dir, "--context-length", "100000",
           "--no-embedding-model", "--port", str(_free_port())]  # fmt: skip
    res = _run(cmd)
    assert res.returncode == 1
    assert "scheduler process failed to start" in res.stderr
    assert "Traceback" in res.stderr and "exceeds the model's maximum of 512" in res.stderr


def test_invalid_option_values_are_refused_before_anything_starts() -> None:
    res = _run([*SERVE, "--dtype", "bogus"], timeout=30)
    assert res.returncode == 2
    assert "invalid choice: 'bogus'" in res.stderr and "float32" in res.stderr
    res = _run([*SERVE, "--max-prefill-tokens", "0"], timeout=30)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--max-prefill-tokens) must be at least 1; got 0" in res.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_prefill_tokens": 0}, "max_prefill_tokens (--max-prefill-tokens) must be at least 1; got 0"),
        ({"mem_fraction": 0.0}, "mem_fraction (--mem-fraction) must be more than 0.0; got 0.0"),
        ({"mem_fraction": 1.5}, "must be at most 1.0; got 1.5"),
        ({"stream_interval": 0}, "stream_interval (--stream-interval) must be at least 1; got 0"),
        ({"port": 70000}, "port (--port) must be at most 65535; got 70000"),
        ({"chunked_prefill_size": -1}, "must be at least 0; got -1"),
        ({"dtype": "fp8"}, "dtype (--dtype) must be one of auto, float32, bfloat16, float16; got 'fp8'"),
        ({"device": "gpu"}, "device (--device) must match auto|cpu|cuda(:\\d+)?; got 'gpu'"),
        ({"health_timeout": float("nan")}, "health_timeout (--health-timeout) must be a number; got nan"),
        ({"log_level": "loud"}, "log_level (--log-level) must be one of debug, info, warning, error"),
    ],
)  # fmt: skip
def test_server_args_refuse_values_out_of_range(change: dict, message: str) -> None:
    # Engine(**kwargs) builds the same ServerArgs, so it refuses them the same way
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs(**change)
    valid = {"dtype": "float32", "device": "cuda:1", "log_level": "debug"}
    ServerArgs(**{k: valid.get(k, 1) for k in change})  # in range: accepted


# ---- watchdog, in process -----------------------------------------------------------------


def test_dead_scheduler_fails_requests_with_503(tiny_llama_dir: str) -> None:
    deaths: list[str] = []

    async def go() -> None:
        args = ServerArgs(model_path=tiny_llama_dir, no_embedding_model=True)
        procs = ServingProcesses(args, deaths.append)
        async with procs as tm:
            params = {"max_new_tokens": 500, "ignore_eos": True}
            gen = tm.generate_request(
                GenerateReqInput(text="x", sampling_params=params, stream=True)
            )
            await gen.__anext__()
            os.kill(procs.pid_of("scheduler"), signal.SIGKILL)
            killed = time.monotonic()
            last = [o async for o in gen][-1]
            assert time.monotonic() - killed < 3.0
            reason = last["meta_info"]["finish_reason"]
            assert (reason["type"], reason["status_code"]) == ("abort", 503)
            assert not tm.is_healthy and not tm.rid_to_state
            with pytest.raises(RequestError) as info:
                await tm.generate_request(GenerateReqInput(text="y")).__anext__()
            assert info.value.status_code == 503
            with pytest.raises(RequestError):
                await tm.get_internal_state()
            detokenizer = psutil.Process(procs.pid_of("detokenizer"))
        assert not detokenizer.is_running() or detokenizer.status() == psutil.STATUS_ZOMBIE

    asyncio.run(asyncio.wait_for(go(), 120))
    assert len(deaths) == 1 and "scheduler" in deaths[0] and "-9" in deaths[0]


# ---- the real server ----------------------------------------------------------------------


class Server:
    """`embedding`: a test model keeps the default embedding model (a `sluice::encoder` child)."""

    def __init__(
        self,
        model_path: str | None,
        tmp_path: Any,
        embedding: bool = False,
        group: bool = False,
        flags: tuple[str, ...] = (),
    ) -> None:
        self.port = _free_port()
        self.log = tmp_path / f"server-{self.port}.log"
        cmd = [*SERVE, "--port", str(self.port), "--max-total-tokens", "4096", *flags]
        if model_path is not None:  # a test model: without the default embedding model
            cmd += ["--model-path", model_path]
            cmd += [] if embedding else ["--no-embedding-model"]
        with open(self.log, "w") as log:
            # group: a process group (and session) of its own, to be signalled whole
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=group
            )
        self.ps = psutil.Process(self.proc.pid)

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log.read_text())

    def children(self) -> dict[str, psutil.Process]:
        kids = self.ps.children(recursive=True)
        return {" ".join(p.cmdline()): p for p in kids}

    def child(self, title: str) -> psutil.Process:
        return next(p for cmd, p in self.children().items() if cmd.startswith(title))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def start_server(tmp_path: Any) -> Iterator[Any]:
    servers: list[Server] = []

    def start(
        model_path: str | None,
        embedding: bool = False,
        group: bool = False,
        flags: tuple[str, ...] = (),
    ) -> Server:
        servers.append(Server(model_path, tmp_path, embedding, group, flags))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _assert_gone(procs: list[psutil.Process], timeout: float = 5) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"orphaned: {alive}"


def _exited_within(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of `procs` still running after `timeout` s (a zombie has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _is_running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sluice_children(server: Server, embedding: bool = True) -> dict[str, psutil.Process]:
    kids = {cmd.split()[0]: p for cmd, p in server.children().items() if cmd.startswith("sluice::")}
    expected = {"sluice::scheduler", "sluice::detokenizer"} | (
        {"sluice::encoder"} if embedding else set()
    )
    assert set(kids) == expected, kids
    return kids


def test_the_stop_signal_exits_each_child_at_once(start_server: Any, tiny_llama_dir: str) -> None:
    server = start_server(tiny_llama_dir, embedding=True)  # with the default embedding model
    server.wait_healthy()
    kids = _sluice_children(server)
    for kid in kids.values():
        kid.send_signal(ipc.STOP_SIGNAL)
    assert not _exited_within(list(kids.values()), 1.0)
    assert server.proc.wait(30) == 1  # a child's death stops the server
    log = server.log.read_text()
    assert "did not stop" not in log and "died (exit code 0)" in log
    for name in ("scheduler", "detokenizer", "embedding"):
        assert f"the {name} process exited with code 0" in log, log


def test_a_sigterm_to_the_whole_process_group_drains(
    start_server: Any, tiny_llama_dir: str
) -> None:
    """A service manager's stop (systemd's KillMode=control-group) signals every process at
    once: the children stay up while the launcher drains, so the request in flight (held queued
    by a pause until the signal) finishes, and every process then exits 0."""
    server = start_server(tiny_llama_dir, group=True)
    server.wait_healthy()
    base = f"http://127.0.0.1:{server.port}"
    kids = _sluice_children(server, embedding=False)
    assert httpx.post(f"{base}/pause_generation", json={"mode": "in_place"}).status_code == 200
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            call = asyncio.create_task(client.post("/generate", json=body))
            deadline = time.monotonic() + 30
            while (await client.get("/get_server_info")).json()["internal_state"][
                "num_waiting_reqs"
            ] != 1:
                assert time.monotonic() < deadline, "the request was not queued"
                await asyncio.sleep(0.01)
            os.killpg(server.proc.pid, signal.SIGTERM)
            return await call

    resp = asyncio.run(go())
    assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 8
    assert server.proc.wait(30) == 0
    assert not _exited_within(list(kids.values()), 5.0)
    log = server.log.read_text()
    assert "did not stop" not in log and "died" not in log, log
    for name in ("scheduler", "detokenizer"):
        assert f"the {name} process exited with code 0" in log, log


def test_sigterm_stops_everything_cleanly(start_server: Any) -> None:
    server = start_server(None)  # the default models, once
    started = time.monotonic()
    server.wait_healthy()
    assert server.ps.cmdline()[0] == "sluice::http"
    kids = _sluice_children(server)
    # no compute pools outside the scheduler: the main thread plus a few helpers
    assert kids["sluice::detokenizer"].num_threads() <= 5
    assert f"http://127.0.0.1:{server.port}" in server.log.read_text()
    assert "KV pool" in server.log.read_text()
    print(f"default model served after {time.monotonic() - started:.1f} s")
    server.proc.send_signal(signal.SIGTERM)
    # every child at once: the interpreter's teardown took a second of CPU per child, and past
    # the launcher's 5 s (then SIGKILL) when several tore down together on a busy machine
    alive = _exited_within(list(kids.values()), 3.0)  # the drain (none in flight), the stop
    assert not alive, f"still running 3 s after SIGTERM: {alive}"
    assert server.proc.wait(30) == 0
    log = server.log.read_text()
    assert "did not stop" not in log
    for name in ("scheduler", "detokenizer", "embedding"):
        assert f"the {name} process exited with code 0" in log, log


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2,
    reason="--cpu-bind auto pins on Linux, with 2 CPUs",
)
@pytest.mark.parametrize("bind", ["auto", "off"])
def test_the_scheduler_pins_its_threads(start_server: Any, tiny_llama_dir: str, bind: str) -> None:
    server = start_server(tiny_llama_dir, flags=("--cpu-bind", bind))
    server.wait_healthy()
    # it serves (OpenMP's threads have run since the pinning)
    reply = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    scheduler = server.child("sluice::scheduler")
    cpus = os.sched_getaffinity(0)
    affinity = {}
    for thread in scheduler.threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            affinity[thread.id] = os.sched_getaffinity(thread.id)
    log = server.log.read_text()
    if bind == "off":
        assert "--cpu-bind off: the OS places every thread" in log
        assert all(a == cpus for a in affinity.values()), affinity
        return
    if "not pinned" in log:  # a CPU quota of less than 2
        pytest.skip(log[log.index("not pinned") :].splitlines()[0])
    found = re.search(r"compute threads \[([\d, ]+)\] on CPUs \[([\d, ]+)\]", log)
    assert found, log
    tids = [int(t) for t in found[1].split(",")]
    pinned = [int(c) for c in found[2].split(",")]
    assert tids[0] == scheduler.pid and pinned[0] == min(cpus)  # the thread that runs the loop
    assert len(tids) == len(pinned) >= 2 and set(pinned) <= cpus
    for tid, cpu in zip(tids, pinned, strict=True):
        assert affinity.pop(tid) == {cpu}
    assert affinity and all(a == cpus - {pinned[0]} for a in affinity.values()), affinity


def test_killed_scheduler_makes_the_server_exit_nonzero(
    start_server: Any, tiny_llama_dir: str
) -> None:
    server = start_server(tiny_llama_dir)
    server.wait_healthy()
    scheduler, detokenizer = server.child("sluice::scheduler"), server.child("sluice::detokenizer")
    scheduler.send_signal(signal.SIGKILL)
    assert server.proc.wait(20) != 0
    assert "scheduler process died" in server.log.read_text()
    _assert_gone([scheduler, detokenizer])


def test_children_exit_when_the_server_is_killed(start_server: Any, tiny_llama_dir: str) -> None:
    server = start_server(tiny_llama_dir)
    server.wait_healthy()
    children = list(server.children().values())
    assert len(children) >= 2
    server.proc.kill()  # SIGKILL: no cleanup in the parent at all
    server.proc.wait(10)
    _assert_gone(children)


# ---- the launcher's last moments ------------------------------------------------------------


def _exit_at_once(code: int, conn: Any) -> None:
    os._exit(code)  # `conn`, a write end, closes with it


def _exit_after_eof(conn: Any) -> None:
    """A worker that ends its drain once the fake scheduler is gone (its pipe reads EOF)."""
    try:
        conn.recv_bytes()
    except EOFError:
        pass
    os._exit(0)


class _FailureRecorder:
    """The TokenizerManager as the watchdog sees it."""

    def __init__(self) -> None:
        self.deaths: list[str] = []

    def on_child_death(self, message: str) -> None:
        self.deaths.append(message)

    async def close(self) -> None:
        pass


def test_a_child_death_while_the_workers_drain_is_reported() -> None:
    """The scheduler dies while the launcher waits for the other workers' drain (the worker
    ends it only once the scheduler is gone): the failure is reported, which makes
    `sluice serve` exit 1."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from sluice.launch import _Child

    ctx = mp.get_context("spawn")
    gone_r, gone_w = ctx.Pipe(duplex=False)
    scheduler = ctx.Process(target=_exit_at_once, args=(3, gone_w), daemon=True)
    worker = ctx.Process(target=_exit_after_eof, args=(gone_r,), daemon=True)
    for proc in (worker, scheduler):
        proc.start()
    gone_r.close()
    gone_w.close()  # the scheduler holds the only write end now
    procs = ServingProcesses(SimpleNamespace(shutdown_timeout=60.0))  # type: ignore[arg-type]
    procs._children = [
        _Child(name, proc, ctx.Pipe(duplex=False)[0])
        for name, proc in (("scheduler", scheduler), ("http-1", worker))
    ]
    procs.tm = tm = _FailureRecorder()  # type: ignore[assignment]
    procs.draining = True
    deaths: list[str] = []
    procs.on_child_death = deaths.append

    async def go() -> None:
        procs._watchdog = asyncio.create_task(procs._watch())
        await procs.__aexit__(None, None, None)

    asyncio.run(go())
    assert procs.failure == "the scheduler process died (exit code 3)"
    assert deaths == [procs.failure] and tm.deaths == [procs.failure]
    assert worker.exitcode == 0


def test_a_signal_before_uvicorns_handlers_is_handled_once_they_are_installed() -> None:
    """SIGTERM right after the workers started (before uvicorn's signal handlers exist) is kept
    by `_keep_signals`, not raised, and `_Server.capture_signals` hands it to `on_signal` (the
    drain, relayed to every worker) as it installs them."""
    import uvicorn

    from sluice.launch import _keep_signals, _Server

    handled: list[int] = []

    async def go() -> list[int]:
        kept = _keep_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the loop runs the handler at its next turn
            if kept:
                break
            await asyncio.sleep(0.01)
        before = list(kept)
        server = _Server(uvicorn.Config(app=None), kept)
        server.on_signal = handled.append  # type: ignore[method-assign]
        with server.capture_signals():
            assert handled == [signal.SIGTERM]
        return before

    assert asyncio.run(go()) == [signal.SIGTERM]
    assert handled == [signal.SIGTERM]
