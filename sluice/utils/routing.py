"""Outputs to their owners: where the detokenizer (and an encoder's scheduler, which has no
detokenizer) sends what goes back to the HTTP workers.

Guarantee: each output reaches the worker named by its `reply_to` (a batch output, whose
`reply_to` is a list parallel to its rids, is split into one message per owner, each keeping
the order of its rows); a heartbeat reaches every worker; anything without an owner, or with an
address that is not a worker's, goes to the first worker. With one worker every message goes
there unchanged, as before there were several.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from sluice.messages import SchedulerHeartbeat
from sluice.utils import ipc


def split_by_owner(msg: Any, owners: list[str]) -> list[tuple[str, Any]]:
    """(owner, the rows of `msg` it owns) per distinct owner, in order of first appearance.
    Every list field of a batch output is a column of its rows: `owners[i]` owns row i of each.
    An empty column (one a sender leaves unfilled: an encoder's `cached_tokens`) stays empty;
    a column of any other length than `owners` is a ValueError, never a silent mis-split.
    One owner: `msg` itself."""
    distinct = list(dict.fromkeys(owners))
    if len(distinct) <= 1:
        return [(distinct[0] if distinct else "", msg)]
    n = len(owners)
    columns = []
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if not isinstance(value, list) or not value:
            continue
        if len(value) != n:
            raise ValueError(f"{type(msg).__name__}.{name} has {len(value)} rows, not {n}")
        columns.append(name)
    parts = []
    for owner in distinct:
        rows = [i for i, o in enumerate(owners) if o == owner]
        changes = {f: [getattr(msg, f)[i] for i in rows] for f in columns}
        parts.append((owner, msgspec.structs.replace(msg, **changes)))
    return parts


class Outbox:
    """One PUSH per owner address; `owners[0]` takes what has no (known) owner."""

    def __init__(self, ctx: zmq.Context, owners: tuple[str, ...] | list[str]) -> None:
        self.owners = list(owners)
        self._socks = {addr: ipc.push_socket(ctx, addr) for addr in self.owners}

    def send(self, msg: Any, owners: list[str] | None = None) -> None:
        """`owners`: the owner of each row of a batch output that carries none itself (the
        detokenizer's BatchStrOutput, whose owners are its BatchTokenIDOutput's)."""
        if len(self.owners) == 1:
            ipc.send(self._socks[self.owners[0]], msg)
            return
        if isinstance(msg, SchedulerHeartbeat):
            for sock in self._socks.values():
                ipc.send(sock, msg)
            return
        reply_to = owners if owners is not None else getattr(msg, "reply_to", "")
        if isinstance(reply_to, str):
            ipc.send(self._sock_of(reply_to), msg)
            return
        for owner, part in split_by_owner(msg, reply_to):
            ipc.send(self._sock_of(owner), part)

    def _sock_of(self, owner: str) -> zmq.Socket:
        return self._socks.get(owner) or self._socks[self.owners[0]]

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
