"""Sessions: multi-turn conversations whose turns the scheduler builds from earlier turns.

`SessionManager` owns every open `Session`, and a session owns the records of its turns: a tree
of `Turn`s keyed by rid, each turn's parent being the turn it was built on (None: a root).
A new turn's prompt is its base turn's prompt plus output (prompt only with
`drop_previous_output`), cut at `offset` (a splice), plus the new input ids. The base is the
turn named by `SessionParams.rid`, by default the session's last finished turn.

Invariants:
  - a turn is in `Session.turns` from `start` until it is rolled back (it ended with an abort)
    or its branch is replaced (`replace`) or the session closes; only finished turns can be a
    base, so a running turn has no children;
  - `Session.last_rid` names a finished turn of the session, or None;
  - a closed (or expired) session leaves nothing here; its turns still running finish as plain
    requests (their finish finds no session and commits nothing).
The KV of earlier turns is reused through the radix cache: a turn's KV is inserted with its
session id as the tag, and the scheduler evicts nodes tagged by an open session last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.messages import OpenSessionReq, SessionParams
from sluice.scheduler.req import Req

EXPIRY_CHECK_INTERVAL_S = 1.0


class SessionError(Exception):
    """A turn the session cannot build: the request ends with a 400 abort carrying `code`."""

    def __init__(self, message: str, code: str = "invalid_session") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass
class Turn:
    rid: str
    parent: str | None
    req: Req | None  # the running request; None once finished
    input_ids: list[int] = field(default_factory=list)  # set when it finishes
    output_ids: list[int] = field(default_factory=list)
    children: list[str] = field(default_factory=list)


@dataclass
class Session:
    id: str
    timeout: float  # seconds idle before expiry; 0: never
    capacity_of_str_len: int  # the most tokens a turn's prompt may hold; 0: no limit
    last_active: float
    turns: dict[str, Turn] = field(default_factory=dict)
    last_rid: str | None = None  # the default base: the last finished turn
    num_running: int = 0


@dataclass
class TurnPlan:
    """What `plan` resolved for a new turn; nothing is changed until `start`."""

    session: Session
    base: Turn | None
    input_ids: list[int]  # the full prompt of the new turn
    replace: bool


class SessionManager:
    def __init__(self, bos_token_id: int | None = None) -> None:
        # stripped from the head of a turn's new ids when it continues a context (the tokenizer
        # prepends it to every text); None when the tokenizer adds no BOS
        self.bos_token_id = bos_token_id
        self.sessions: dict[str, Session] = {}
        self._next_expiry_check = 0.0

    def __len__(self) -> int:
        return len(self.sessions)

    # ---- open and close -------------------------------------------------------------------

    def open(self, msg: OpenSessionReq, now: float) -> str | None:
        """Open a session; returns an error message when it cannot be opened."""
        if not msg.session_id:
            return "the session id is empty"
        if msg.session_id in self.sessions:
            return f"session {msg.session_id!r} is already open"
        if msg.timeout < 0:
            return "the session timeout must be >= 0"
        self.sessions[msg.session_id] = Session(
            msg.session_id, msg.timeout, msg.capacity_of_str_len, now
        )
        return None

    def close(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Close the sessions idle (no turn running) for longer than their timeout; looks at
        most once per EXPIRY_CHECK_INTERVAL_S. Returns the closed ids."""
        if now < self._next_expiry_check:
            return []
        self._next_expiry_check = now + EXPIRY_CHECK_INTERVAL_S
        expired = [
            s.id
            for s in self.sessions.values()
            if s.timeout > 0 and s.num_running == 0 and now - s.last_active > s.timeout
        ]
        for sid in expired:
            del self.sessions[sid]
        return expired

    # ---- turns ----------------------------------------------------------------------------

    def plan(self, params: SessionParams, rid: str, new_ids: list[int]) -> TurnPlan:
        """Resolve the base turn and build the new turn's prompt; raises SessionError."""
        session = self.sessions.get(params.id)
        if session is None:
            raise SessionError(f"session {params.id!r} is not open (unknown, closed or expired)")
        if rid in session.turns:
            raise SessionError(f"session {params.id!r} already has a request with rid {rid!r}")
        base = self._base(session, params)
        context: list[int] = []
        if base is not None:
            context = base.input_ids + ([] if params.drop_previous_output else base.output_ids)
        if params.offset is not None:
            if not 0 <= params.offset <= len(context):
                raise SessionError(
                    f"session offset {params.offset} is outside the context of the base request "
                    f"({len(context)} tokens)"
                )
            context = context[: params.offset]
        if context and self.bos_token_id is not None and new_ids[:1] == [self.bos_token_id]:
            new_ids = new_ids[1:]
        input_ids = context + new_ids
        capacity = session.capacity_of_str_len
        if 0 < capacity < len(input_ids):
            raise SessionError(
                f"this turn's prompt in session {params.id!r} would be {len(input_ids)} tokens, "
                f"over the session's capacity_of_str_len of {capacity} tokens"
            )
        return TurnPlan(session, base, input_ids, params.replace)

    def _base(self, session: Session, params: SessionParams) -> Turn | None:
        if params.rid is None:
            return session.turns[session.last_rid] if session.last_rid is not None else None
        base = session.turns.get(params.rid)
        if base is None:
            raise SessionError(
                f"session {session.id!r} has no finished request with rid {params.rid!r}"
            )
        if base.req is not None:
            raise SessionError(
                f"request {params.rid!r} of session {session.id!r} has not finished; a turn "
                "can only continue a finished one"
            )
        return base

    def start(self, plan: TurnPlan, req: Req, now: float) -> list[Req]:
        """Record `req` as a turn of the plan's session. With `replace`, the base's earlier
        branches are dropped; returns their running requests, which the caller aborts."""
        session, base = plan.session, plan.base
        victims: list[Req] = []
        if plan.replace:
            roots = base.children if base is not None else _roots(session)
            for rid in list(roots):
                victims += self._drop(session, rid)
            if session.last_rid not in session.turns:
                session.last_rid = base.rid if base is not None else None
        parent = base.rid if base is not None else None
        session.turns[req.rid] = Turn(req.rid, parent, req)
        if base is not None:
            base.children.append(req.rid)
        session.num_running += 1
        session.last_active = now
        req.session_id = session.id
        return victims

    def on_finish(self, req: Req, now: float) -> None:
        """Commit a finished turn (it becomes the default base), or roll back an aborted one."""
        session = self.sessions.get(req.session_id or "")
        turn = session.turns.get(req.rid) if session is not None else None
        if session is None or turn is None or turn.req is not req:
            return  # its session closed, or its branch was replaced
        session.last_active = now
        if req.finished_reason is not None and req.finished_reason.type == "abort":
            self._drop(session, req.rid)
            return
        session.num_running -= 1
        turn.req = None
        turn.input_ids, turn.output_ids = req.origin_input_ids, list(req.output_ids)
        session.last_rid = req.rid

    def _drop(self, session: Session, rid: str) -> list[Req]:
        """Remove a turn and its descendants; returns their running requests."""
        turn = session.turns.pop(rid)
        if turn.parent is not None and (parent := session.turns.get(turn.parent)) is not None:
            parent.children.remove(rid)
        running = []
        if turn.req is not None:
            running.append(turn.req)
            session.num_running -= 1
        for child in list(turn.children):
            running += self._drop(session, child)
        return running


def _roots(session: Session) -> list[str]:
    return [t.rid for t in session.turns.values() if t.parent is None]


def prepended_bos(tokenizer: object) -> int | None:
    """The BOS id the tokenizer puts before every encoded text, or None if it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    encode = getattr(tokenizer, "encode", None)
    if bos is None or encode is None:
        return None
    return bos if list(encode("a"))[:1] == [bos] else None
