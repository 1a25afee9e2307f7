"""The extra HTTP workers of `--tokenizer-worker-num N` (N > 1): processes 1..N-1, each with its
own TokenizerManager (and encoder managers), its own app and its own SO_REUSEPORT listening
socket on --port, in front of the one scheduler and detokenizer. The launcher is worker 0.

A worker is a child of the launcher like the model processes: it ignores SIGINT and SIGTERM
(the launcher relays a drain as PeerDrain, and a process failure as PeerFailure: it fails its
requests with 503 and exits), exits at once on STOP_SIGNAL, and exits when the launcher is gone.
It reports ready on its pipe once it listens, and on its way out tells the other workers it is
leaving (`Peers.close`), so their fan-outs stop waiting for it. The launcher treats a worker's
death like any child's: every request fails with 503 and the server exits (no restart: the
scheduler may hold the dead worker's requests and sessions, and a fresh one would not know
them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import traceback
from collections.abc import Iterator
from typing import Any

import uvicorn

from sluice.checkpoint.encoder_config import EncoderConfig
from sluice.config import ServerArgs
from sluice.messages import ModelInfo, PeerDrain, PeerFailure, ReadyMsg
from sluice.tokenizer.embedding_manager import EncoderManager, EncoderSpec, start_manager
from sluice.tokenizer.encoder_frontend import EncoderFrontend
from sluice.tokenizer.main_model import MainModel
from sluice.tokenizer.manager import TokenizerManager
from sluice.utils import ipc
from sluice.utils.event_loop import run_loop

logger = logging.getLogger(__name__)

STARTED_POLL_S = 0.05


def start_managers(
    args: ServerArgs, cfg: Any, tokenizer: Any, addrs: ipc.IpcAddrs, info: ModelInfo | None,
    encoders: list[EncoderSpec], encoder_infos: list[ModelInfo], index: int = 0,
) -> tuple[MainModel, list[EncoderManager]]:  # fmt: skip
    """The main model's manager and the encoder models' of HTTP worker `index`, started (on
    the running event loop), each on this worker's own reply address."""
    embedders = []
    for spec, enc_info in zip(encoders, encoder_infos, strict=True):
        own = EncoderSpec(spec.name, spec.args, spec.addrs.for_worker(index))
        embedders.append(start_manager(own, enc_info))
        embedders[-1].start()
    if isinstance(cfg, EncoderConfig):  # the main model is an encoder: no generation
        return EncoderFrontend(embedders[0], cfg), embedders
    assert info is not None
    tm = TokenizerManager(args, cfg, tokenizer, addrs.for_worker(index), info)
    tm.start()
    return tm, embedders


def fail_all(tm: MainModel, embedders: list[EncoderManager], message: str) -> None:
    tm.on_child_death(message)
    for embedder in embedders:
        embedder.on_child_death(message)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that every HTTP worker binds alike (the kernel spreads
    the connections over them)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_http_worker(
    index: int, args: ServerArgs, cfg: Any, addrs: ipc.IpcAddrs, encoders: list[EncoderSpec],
    start_conn: Any, ready_conn: Any,
) -> None:  # fmt: skip
    """Entry point of the spawned worker `index`: serve until told to stop. It is spawned
    beside the model processes; `start_conn` brings their handshakes, (the main model's info or
    None, the encoders' infos), once they are ready."""
    title = f"sluice::http-{index}"
    ipc.setup_child_process(title, args.log_level)
    ipc.exit_on_stop_signal()
    worker = _Worker(index, args, cfg, addrs, encoders, start_conn)
    try:
        run_loop(worker.serve(ready_conn))
    except BaseException:
        if not worker.reported:
            ipc.report_ready(ready_conn, ReadyMsg(title, error=traceback.format_exc()))
        raise SystemExit(1) from None
    raise SystemExit(1 if worker.failure else 0)


class _Worker:
    def __init__(self, index: int, args: ServerArgs, *start: Any) -> None:
        self.index, self.args, self.start = index, args, start
        self.reported = False
        self.failure: str | None = None

    async def serve(self, ready_conn: Any) -> None:
        from sluice.server.app import create_app
        from sluice.server.peers import Peers
        from sluice.server.shutdown import GracefulShutdown

        cfg, addrs, encoders, start_conn = self.start
        tokenizer = None
        if not isinstance(cfg, EncoderConfig):  # loaded while the model processes start
            from sluice.utils.tokenizer import get_tokenizer

            tokenizer = await asyncio.to_thread(get_tokenizer, cfg.hf_dir)
        info, encoder_infos = await asyncio.to_thread(start_conn.recv)
        start_conn.close()
        args = self.args
        tm, embedders = start_managers(
            args, cfg, tokenizer, addrs, info, encoders, encoder_infos, self.index
        )
        peers = Peers(self.index, addrs.peers)
        try:
            app = create_app(tm, args, embedders=embedders, peers=peers)
            config = uvicorn.Config(
                app, log_level=args.log_level, timeout_graceful_shutdown=5, loop="none"
            )  # the loop is run_loop's
            server = WorkerServer(config)
            drain = GracefulShutdown(server, tm, args.shutdown_timeout, embedders)

            def on_peer(msg: Any) -> Any:
                match msg:
                    case PeerFailure():
                        self.failure = msg.message
                        fail_all(tm, embedders, msg.message)
                        server.should_exit = True
                    case PeerDrain():
                        drain.on_signal(signal.SIGTERM)
                    case _:
                        return app.state.workers.handle(msg)
                return None

            peers.start(on_peer)
            await self._serve_until_stopped(server, ready_conn)
        finally:
            await peers.close()
            await tm.close()
            for embedder in embedders:
                await embedder.close()

    async def _serve_until_stopped(self, server: uvicorn.Server, ready_conn: Any) -> None:
        sock = reuseport_socket(self.args.host, self.args.port)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                serving.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped before it started")
            await asyncio.sleep(STARTED_POLL_S)
        ipc.report_ready(ready_conn, ReadyMsg(f"http-{self.index}"))
        self.reported = True
        await serving


class WorkerServer(uvicorn.Server):
    """A worker's uvicorn server: signals stay ignored (the launcher relays them as PeerDrain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
