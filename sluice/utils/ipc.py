"""Framing of `sluice.messages` structs over ZMQ, and the plumbing every child process shares.

A message travels as one frame: its msgpack encoding, tagged with its type (`messages.Message`).
Each receiver decodes with the `Inbox` of the closed union it takes (`messages.ToScheduler`,
`ToDetokenizer`, `ToHttp`), so one socket carries several message types, decoding is typed (no
pickle) and a message its receiver does not take is malformed there.

Socket layout (every PULL binds, every PUSH connects, all under one private temp dir):
  TokenizerManager ──▶ scheduler_in    (requests, aborts, control requests)
  scheduler, TM    ──▶ detokenizer_in  (token-id batches, control replies, aborts)
  detokenizer      ──▶ tokenizer_in    (text batches, control replies)
With --tokenizer-worker-num N, each HTTP worker has its own tokenizer_in (`IpcAddrs.owners`):
every request and control request carries it as `reply_to`, and the detokenizer (or an
encoder's scheduler) sends each output to its owner (`sluice.utils.routing.Outbox`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from sluice import messages

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()


class HeartbeatTimer:
    """When a model loop's next SchedulerHeartbeat is due: a few per readiness window
    (--health-timeout), at most one a second, busy or idle."""

    def __init__(self, health_timeout: float) -> None:
        self.interval = min(1.0, max(health_timeout, 0.1) / 4)
        self.last = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True


def encode(msg: messages.Message) -> bytes:
    if not isinstance(msg, messages.Message):
        raise TypeError(f"{type(msg)!r} is not a message of sluice.messages")
    return _ENCODER.encode(msg)


class Inbox:
    """The decoder of one receiver: `union` is the closed union of the messages it takes."""

    def __init__(self, union: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, data: bytes) -> Any:
        """The message `encode` made; ValueError for anything malformed, and for a message
        of a type this receiver does not take."""
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed message: {e}") from e


def send(sock: zmq.Socket, msg: messages.Message) -> None:
    sock.send(encode(msg), copy=False)


def recv_all(sock: zmq.Socket, timeout_ms: int) -> list[bytes]:
    """Every message waiting on `sock`, after waiting up to `timeout_ms` for the first."""
    batch: list[bytes] = []
    if timeout_ms > 0 and not sock.poll(timeout_ms, zmq.POLLIN):
        return batch
    while True:
        try:
            batch.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return batch


@dataclass(frozen=True)
class IpcAddrs:
    """`tokenizer_in` is this HTTP worker's own PULL; `owners` holds every worker's (the first
    is the launcher's, and takes what has no owner); `peers` their worker-to-worker sockets
    (none with one worker). An encoder's scheduler has no detokenizer: its `detokenizer_in` is
    the first owner, and it sends straight to each output's owner."""

    root: str  # private temp dir holding the socket files; removed by `remove`
    scheduler_in: str
    detokenizer_in: str
    tokenizer_in: str
    owners: tuple[str, ...] = ()  # empty: (tokenizer_in,)
    peers: tuple[str, ...] = ()

    @classmethod
    def create(cls, num_workers: int = 1) -> IpcAddrs:
        root = tempfile.mkdtemp(prefix="sluice-")
        base = (f"ipc://{root}/{n}" for n in ("scheduler", "detokenizer", "tokenizer"))
        addrs = cls(root, *base)
        if num_workers == 1:
            return addrs
        owners = (
            addrs.tokenizer_in,
            *(f"ipc://{root}/tokenizer-{i}" for i in range(1, num_workers)),
        )
        peers = tuple(f"ipc://{root}/peer-{i}" for i in range(num_workers))
        return dataclasses.replace(addrs, owners=owners, peers=peers)

    @property
    def all_owners(self) -> tuple[str, ...]:
        return self.owners or (self.tokenizer_in,)

    @property
    def has_detokenizer(self) -> bool:
        return self.detokenizer_in not in self.all_owners

    def for_worker(self, index: int) -> IpcAddrs:
        """The addresses as HTTP worker `index` uses them (its own `tokenizer_in`)."""
        return dataclasses.replace(self, tokenizer_in=self.all_owners[index])

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A PUSH that never blocks nor drops: no high-water mark; pending messages die on close."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


# ---------------------------------------------------------------------------- child processes


STOP_SIGNAL = signal.SIGUSR1  # how the launcher stops a child (a clean exit, at once)


def setup_child_process(title: str, log_level: str) -> None:
    """Name the process, configure logging, leave Ctrl-C to the parent, die with the parent."""
    from setproctitle import setproctitle

    setproctitle(title)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # a terminal's Ctrl-C and a service manager's SIGTERM reach the whole group: the launcher
    # answers them (a drain), then stops its children with STOP_SIGNAL
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, title)
    _watch_parent(os.getppid())


def die_with_parent() -> None:
    """Exit (status 1) within half a second of the parent's end: for a helper process (a media
    pool's) that `setup_child_process` does not set up."""
    _watch_parent(os.getppid())


def configure_logging(log_level: str, name: str) -> None:
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit as soon as the parent is gone (re-parented), so no child outlives the server."""

    def watch() -> None:
        # the stop signal is the main thread's to take (its handler runs there anyway)
        signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def report_ready(conn: Any, msg: messages.ReadyMsg) -> None:
    """Send the start-up handshake on a multiprocessing Connection and close it."""
    conn.send_bytes(_ENCODER.encode(msg))
    conn.close()


def run_child(title: str, log_level: str, ready_conn: Any, build: Callable[[], Any]) -> None:
    """Entry of a model-serving child: name the process, build its loop, report ready (or the
    start-up traceback, then exit 1), and run the loop until the launcher stops it (STOP_SIGNAL:
    `exit_on_stop_signal`). `build()` returns an object with `info() -> ModelInfo` and
    `run_forever()`."""
    setup_child_process(title, log_level)
    try:
        loop = build()
    except BaseException:
        report_ready(ready_conn, messages.ReadyMsg("scheduler", error=traceback.format_exc()))
        raise SystemExit(1) from None
    exit_on_stop_signal()  # before the handshake: the launcher may stop any child once it is ready
    report_ready(ready_conn, messages.ReadyMsg("scheduler", info=loop.info()))
    loop.run_forever()


def exit_on_stop_signal() -> None:
    """From now on STOP_SIGNAL (the launcher's stop) ends this process at once, with status 0.

    Not SIGTERM, which a child ignores (`setup_child_process`): a SIGTERM sent to the whole
    process group (systemd's default `KillMode=control-group`, `kill -- -PGID`) must leave the
    children serving while the launcher drains, and the launcher stops them after. Not
    `sys.exit`: the interpreter's teardown (garbage collection of torch's and transformers'
    module graphs, torch's finalizers unregistering every operator library) takes about a
    second of CPU per process even on a quiet machine, and several children tearing down at
    once on a busy one ran past the launcher's STOP_TIMEOUT_S. A child owns nothing that needs
    it: its sockets and files are closed by the kernel, the socket dir is the launcher's."""
    signal.signal(STOP_SIGNAL, _exit_now)


def _exit_now(signum: int, frame: Any) -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a signal inside a write: a reentrant flush fails
            stream.flush()
    os._exit(0)


_READY = Inbox(messages.ReadyMsg)


def read_ready(data: bytes) -> messages.ReadyMsg:
    """The handshake `report_ready` sent; ValueError for anything malformed."""
    return _READY.decode(data)
