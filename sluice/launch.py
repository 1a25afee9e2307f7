"""Starting, watching and stopping sluice's processes.

`ServingProcesses` spawns the scheduler (model inside) and the detokenizer, waits for both
start-up handshakes, and yields a TokenizerManager wired to them; a watchdog task notices a dead
child within WATCHDOG_INTERVAL_S. `launch_server` adds the HTTP server (uvicorn) in this process.

With --tokenizer-worker-num N > 1 this process is HTTP worker 0 and `ServingProcesses` also
spawns workers 1..N-1 (`server/http_worker.py`) beside the model processes: each imports and
loads its tokenizer while the model loads, and gets the model processes' handshakes on its start
pipe once they are ready; they are children like the others. A signal here drains every worker
(relayed as PeerDrain), one that comes before uvicorn's handlers are installed too; the watchdog
keeps watching while the other workers drain.

Guarantees: no child outlives `ServingProcesses` (terminated on exit, and each child exits by
itself when its parent is gone); a failed start reports the child's traceback; after a child
died (an HTTP worker included), every request of every worker fails with 503 and `sluice serve`
exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from sluice.checkpoint.encoder_config import EncoderConfig, is_encoder_model, load_encoder_config
from sluice.checkpoint.hf_dir import load_model_config
from sluice.config import ServerArgs
from sluice.detokenizer.process import run_detokenizer_process
from sluice.messages import ModelInfo, PeerDrain, PeerFailure, ReadyMsg
from sluice.scheduler.process import run_scheduler_process
from sluice.server.http_worker import fail_all, reuseport_socket, run_http_worker, start_managers
from sluice.server.peers import Peers
from sluice.tokenizer.embedding_manager import EncoderManager, EncoderSpec, plan_encoders
from sluice.tokenizer.main_model import MainModel
from sluice.utils import ipc
from sluice.utils.event_loop import run_loop

logger = logging.getLogger(__name__)

PROCESS_TITLE = "sluice::http"
STARTUP_TIMEOUT_S = 900.0
WATCHDOG_INTERVAL_S = 0.5
STOP_TIMEOUT_S = 5.0


class StartupError(RuntimeError):
    pass


@dataclass
class _Child:
    name: str
    process: mp.process.BaseProcess
    ready_conn: multiprocessing.connection.Connection  # the parent's read end
    is_ready: bool = False  # its handshake was read
    start_conn: multiprocessing.connection.Connection | None = None  # an HTTP worker's: write end

    @property
    def is_worker(self) -> bool:
        return self.start_conn is not None


class ServingProcesses:
    """`async with ServingProcesses(args) as tm:` runs the scheduler and detokenizer processes
    for the block's duration. `on_child_death(message)` is called (once) when a child dies."""

    def __init__(
        self, args: ServerArgs, on_child_death: Callable[[str], None] | None = None
    ) -> None:
        self.args = args
        self.on_child_death = on_child_death
        self.failure: str | None = None  # why a child died, once one has
        self.addrs: ipc.IpcAddrs | None = None  # created on entry, removed on exit
        self.tm: MainModel | None = None
        self.embedders: list[EncoderManager] = []  # extra encoder models, one child each
        self.peers: Peers | None = None  # worker 0's line to the other HTTP workers
        self.draining = False  # set when the drain begins: the other workers then exit too
        self._encoders: list[EncoderSpec] = []
        self._encoder_infos: list[dict[str, Any]] = []  # their ready handshakes, in order
        self._children: list[_Child] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._abandoned = False  # the start was interrupted

    def pid_of(self, name: str) -> int | None:
        """The pid of child `name` ("scheduler" or "detokenizer")."""
        return next((c.process.pid for c in self._children if c.name == name), None)

    async def __aenter__(self) -> MainModel:
        self.addrs = ipc.IpcAddrs.create(self.args.tokenizer_worker_num)
        start = asyncio.get_running_loop().run_in_executor(None, self._start)
        try:
            cfg, tokenizer, info = await asyncio.shield(start)
        except asyncio.CancelledError:
            self._abandoned = True  # the start spawns no HTTP worker after this
            with contextlib.suppress(Exception):
                await start  # let the start finish, then undo it
            self._stop_children()
            raise
        except BaseException:
            self._stop_children()
            raise
        try:
            self._start_managers(cfg, tokenizer, info)
        except BaseException:
            await self.__aexit__()
            raise
        self._watchdog = asyncio.create_task(self._watch())
        return self.tm

    def _start_managers(self, cfg: Any, tokenizer: Any, info: ModelInfo | None) -> None:
        self.tm, self.embedders = start_managers(
            self.args, cfg, tokenizer, self.addrs, info, self._encoders, self._encoder_infos
        )
        if self.addrs.peers:
            self.peers = Peers(0, self.addrs.peers)
        if not isinstance(cfg, EncoderConfig):
            logger.info(
                "model %s: context %s tokens, KV pool %s tokens, up to %s running requests, "
                "%s on %s with %s threads",
                self.tm.model_name, info.context_len, info.max_total_tokens,
                info.max_running_requests, info.dtype, info.device, info.num_threads,
            )  # fmt: skip

    async def __aexit__(self, *exc: object) -> None:
        # the watchdog runs on while the other workers drain (a death then is reported too),
        # and looks once more after they are gone, before their children are stopped
        await self._wait_workers()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            if self.failure is None:
                self._check_children()
        if self.peers is not None:
            await self.peers.close()
        if self.tm is not None:
            await self.tm.close()
        for embedder in self.embedders:
            await embedder.close()
        self._stop_children()

    async def _wait_workers(self) -> None:
        """Let the other HTTP workers end their drain (or send their 503s after a failure)
        and exit by themselves before their children go."""
        workers = [c for c in self._children if c.name.startswith("http-")]
        wait_s = self.args.shutdown_timeout + STOP_TIMEOUT_S if self.draining else 2.0
        deadline = time.monotonic() + wait_s
        for child in workers:
            left = max(deadline - time.monotonic(), 0)
            await asyncio.get_running_loop().run_in_executor(None, child.process.join, left)

    # ---- start and stop (blocking) ---------------------------------------------------------

    def _start(self) -> tuple[Any, Any, ModelInfo | None]:
        """(model config, tokenizer, scheduler info) of the main model; for an encoder main
        model (EncoderConfig) the tokenizer and info are its manager's, made later."""
        from sluice.utils.tokenizer import get_tokenizer

        path = self.args.model_path
        main_is_encoder = is_encoder_model(path)
        try:  # a GGUF is converted once, here
            cfg = load_encoder_config(path) if main_is_encoder else load_model_config(path)
        except (OSError, ValueError, KeyError) as e:
            raise StartupError(f"cannot load the model: {e}") from e
        ctx = mp.get_context("spawn")
        if not main_is_encoder:
            self._spawn(ctx, "scheduler", run_scheduler_process, self.args, self.addrs)
            self._spawn(
                ctx, "detokenizer", run_detokenizer_process, cfg.hf_dir, self.args.log_level,
                self.addrs,
            )  # fmt: skip
        self._spawn_encoders(ctx)
        self._spawn_workers(ctx, cfg)
        tokenizer = None if main_is_encoder else get_tokenizer(cfg.hf_dir)  # while they start
        ready = self._wait_ready(workers=False)
        self._start_embedders(ready)
        info = None if main_is_encoder else ready["scheduler"].info
        self._start_workers(info)
        return cfg, tokenizer, info

    def _spawn_workers(self, ctx: Any, cfg: Any) -> None:
        """HTTP workers 1..N-1 (--tokenizer-worker-num), beside the model processes: each
        waits on its start pipe for their handshakes (`_start_workers`)."""
        assert self.addrs is not None
        for index in range(1, self.args.tokenizer_worker_num):
            start_reader, start_writer = ctx.Pipe(duplex=False)
            # not daemonic: a worker's media pool starts processes of its own, which a daemonic
            # process may not; _stop_children ends it like the others
            self._spawn(
                ctx, f"http-{index}", run_http_worker, index, self.args, cfg, self.addrs,
                self._encoders, start_reader, daemon=False,
            )  # fmt: skip
            start_reader.close()  # the worker holds the only read end
            self._children[-1].start_conn = start_writer

    def _start_workers(self, info: ModelInfo | None) -> None:
        """Send each HTTP worker the model processes' handshakes; returns when each listens."""
        workers = [c for c in self._children if c.is_worker]
        if self._abandoned or not workers:
            return
        for child in workers:
            assert child.start_conn is not None
            child.start_conn.send((info, self._encoder_infos))
        self._wait_ready(workers=True)
        logger.info("%d HTTP workers", self.args.tokenizer_worker_num)

    def _spawn_encoders(self, ctx: Any) -> None:
        """One scheduler process per extra encoder model (embedding, rerank)."""
        try:
            self._encoders = plan_encoders(self.args)
        except ValueError as e:
            raise StartupError(str(e)) from e
        for spec in self._encoders:
            self._spawn(ctx, spec.name, run_scheduler_process, spec.args, spec.addrs)

    def _start_embedders(self, ready: dict[str, ReadyMsg]) -> None:
        from sluice.utils.tokenizer import get_tokenizer

        for spec in self._encoders:
            info = ready[spec.name].info
            get_tokenizer(info.hf_dir)  # loaded here, off the event loop, and cached
            self._encoder_infos.append(info)
            logger.info(
                "%s model %s: context %s tokens, %s dimensions, %s threads", spec.name,
                info.model_name, info.context_len, info.dimensions, info.num_threads,
            )  # fmt: skip

    def _spawn(
        self, ctx: Any, name: str, target: Callable[..., None], *args: Any, daemon: bool = True
    ) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=target, args=(*args, writer), name=f"sluice-{name}")
        process.daemon = daemon
        process.start()
        writer.close()  # the child holds the only write end: its death reads as EOF here
        self._children.append(_Child(name, process, reader))

    def _wait_ready(self, workers: bool) -> dict[str, ReadyMsg]:
        """The handshakes of the HTTP workers (`workers`) or of the model processes (not
        `workers`) that have not sent theirs yet."""
        pending = {
            c.ready_conn: c for c in self._children if not c.is_ready and c.is_worker == workers
        }
        ready: dict[str, ReadyMsg] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            conns = multiprocessing.connection.wait(list(pending), timeout=max(left, 0))
            if not conns:
                names = ", ".join(c.name for c in pending.values())
                raise StartupError(f"{names} not ready after {STARTUP_TIMEOUT_S:.0f} s")
            for conn in conns:
                child = pending.pop(conn)  # type: ignore[call-overload]
                ready[child.name] = self._read_ready(child)
                child.is_ready = True
        return ready

    @staticmethod
    def _read_ready(child: _Child) -> ReadyMsg:
        try:
            msg = ipc.read_ready(child.ready_conn.recv_bytes())
        except EOFError:
            child.process.join(1.0)
            raise StartupError(
                f"the {child.name} process exited (code {child.process.exitcode}) before it "
                "was ready"
            ) from None
        if msg.error:
            raise StartupError(f"the {child.name} process failed to start:\n{msg.error}")
        return msg

    def _stop_children(self) -> None:
        """STOP_SIGNAL to every child at once (each exits within milliseconds: see
        `ipc.exit_on_stop_signal`), then SIGKILL to any still alive STOP_TIMEOUT_S later."""
        for child in self._children:
            if child.process.is_alive() and child.process.pid is not None:
                os.kill(child.process.pid, ipc.STOP_SIGNAL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self._children:
            child.process.join(max(deadline - time.monotonic(), 0))
            if child.process.is_alive():
                logger.warning(
                    "the %s process did not stop within %g s; killing it",
                    child.name,
                    STOP_TIMEOUT_S,
                )
                child.process.kill()
                child.process.join(1.0)
            logger.info("the %s process exited with code %s", child.name, child.process.exitcode)
            child.ready_conn.close()
            if child.start_conn is not None:
                child.start_conn.close()
        if self.addrs is not None:
            self.addrs.remove()
        for spec in self._encoders:
            spec.addrs.remove()

    # ---- watchdog -------------------------------------------------------------------------

    def _is_dead(self, child: _Child) -> bool:
        """Dead before its time: an HTTP worker's clean exit ends a drain."""
        if child.process.is_alive():
            return False
        drained = self.draining and child.name.startswith("http-")
        return not (drained and child.process.exitcode == 0)

    async def _watch(self) -> None:
        while not self._check_children():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)

    def _check_children(self) -> bool:
        """True (once reported) when a child died before its time: every request fails with
        503, the other workers are told, and `on_child_death` is called."""
        dead = next((c for c in self._children if self._is_dead(c)), None)
        if dead is None:
            return False
        self.failure = f"the {dead.name} process died (exit code {dead.process.exitcode})"
        logger.error("%s: failing all requests and shutting down", self.failure)
        if self.tm is not None:
            fail_all(self.tm, self.embedders, self.failure)
        if self.peers is not None:
            self.peers.tell(PeerFailure(self.failure))
        if self.on_child_death is not None:
            self.on_child_death(self.failure)
        return True


# ---------------------------------------------------------------------------- the HTTP server


def launch_server(args: ServerArgs) -> int:
    """Run `sluice serve` until a signal or a child's death; returns the exit status."""
    from setproctitle import setproctitle

    setproctitle(PROCESS_TITLE)
    ipc.configure_logging(args.log_level, PROCESS_TITLE)
    # until uvicorn takes over signals, SIGTERM stops the start-up like Ctrl-C does
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        _check_port_free(args.host, args.port)  # before minutes of model loading, not after
        return run_loop(_serve(args))
    except StartupError as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 0
    finally:
        _stop_strays()


def _stop_strays() -> None:
    """STOP_SIGNAL to any child an interrupted start left running: a child ignores the SIGTERM
    that multiprocessing's exit handler sends its daemons before joining them, which would
    leave this process waiting for it forever."""
    for child in mp.active_children():
        if child.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, ipc.STOP_SIGNAL)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


async def _serve(args: ServerArgs) -> int:
    server: uvicorn.Server | None = None

    def on_child_death(message: str) -> None:
        if server is not None:
            server.should_exit = True

    procs = ServingProcesses(args, on_child_death)
    async with procs as tm:
        # the other workers listen from here: a signal before uvicorn's handlers are in place
        # is kept, and handled (a drain) as soon as they are
        early = _keep_signals()
        app = _create_app(tm, args, procs.embedders, procs.peers)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level,
            timeout_graceful_shutdown=5, loop="none",  # the loop is run_loop's
        )  # fmt: skip
        server = _Server(config, early)
        from sluice.server.shutdown import GracefulShutdown  # the HTTP layer, only here

        drain = GracefulShutdown(server, tm, args.shutdown_timeout, procs.embedders)
        server.on_signal = drain.on_signal
        sockets = None  # one worker: uvicorn binds the port itself
        if procs.peers is not None:
            server.on_signal = _relaying(drain.on_signal, procs)
            procs.peers.start(app.state.workers.handle)
            sockets = [reuseport_socket(args.host, args.port)]
        announce = asyncio.create_task(_announce(server, args))
        if procs.failure is None:
            await server.serve(sockets=sockets)
        announce.cancel()
    if procs.failure is not None:
        logger.error("exiting: %s", procs.failure)
        return 1
    logger.info("stopped")
    return 0


def _relaying(on_signal: Callable[[int], None], procs: ServingProcesses) -> Callable[[int], None]:
    """The launcher's signal handling with several HTTP workers: each drains as it does."""

    def relay(sig: int) -> None:
        procs.draining = True
        assert procs.peers is not None
        procs.peers.tell(PeerDrain())
        on_signal(sig)

    return relay


async def _announce(server: Any, args: ServerArgs) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    logger.info("sluice is ready: listening on http://%s:%d", args.host, args.port)


def _keep_signals() -> list[int]:
    """SIGINT and SIGTERM, from now until `_Server.capture_signals` takes them over, are
    appended to the list returned (and not raised as KeyboardInterrupt)."""
    kept: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, kept.append, sig)
    return kept


class _Server(uvicorn.Server):
    """A uvicorn server whose signals only ask it to stop (through `on_signal`, the graceful
    drain): uvicorn's own handling re-raises the signal after serving, which would kill this
    process before the children are stopped. `early`: signals that came before its handlers
    were installed (`_keep_signals`), handled as soon as they are."""

    def __init__(self, config: uvicorn.Config, early: list[int] | None = None) -> None:
        super().__init__(config)
        self.early = early if early is not None else []

    def on_signal(self, sig: int) -> None:
        self.handle_exit(sig, None)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda s=sig: self.on_signal(s))
        early, self.early[:] = list(self.early), []
        for sig in early:
            self.on_signal(sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def _create_app(
    tm: MainModel, args: ServerArgs, embedders: list[EncoderManager] | None = None,
    peers: Peers | None = None,
) -> Any:  # fmt: skip
    from sluice.server.app import create_app  # the HTTP layer, only in this process

    return create_app(tm, args, embedders=embedders, peers=peers)
