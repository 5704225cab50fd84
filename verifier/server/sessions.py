"""Sessions: a sequence in a slot, seen from the wire.

Everything here runs on the event loop thread. Slot accounting is done here, ahead of the
engine: `reserve` counts a slot as taken the moment an OpenSession is admitted (its prefill is
still queued for the worker thread), and `remove` gives it back the moment a session is closed
or reaped (its release is queued for the worker behind any step still running on that slot).
The worker runs jobs in order, so the engine's pool never sees more admits than free slots.

Retries (verifier/server/retries.py): a session keeps the results of its last
`results_per_session` answered steps with a request id, each beside its request's fingerprint;
OpenSession calls with a request id are kept (fingerprint, admitting task) while their session
lives and, once it is closed or reaped, among the last GONE_REMEMBERED such: a duplicate of the
open that arrives late (its first call abandoned by its caller, handled after the session it made
was closed) gets that session's response again (AIP-155), never a second session no one knows.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .. import rpc
from ..engine import Sequence
from .answer import Answer
from .retries import Fingerprint

if TYPE_CHECKING:
    from .drafting import ServerDrafter

GONE_REMEMBERED = 4096  # ids of closed / reaped sessions kept to say why a later call fails


class StoredResult(NamedTuple):  # a tuple: one is made per answered step with a request id
    fingerprint: Fingerprint  # of the request that produced it: a retry must match
    result: rpc.StepResult


@dataclass(eq=False)
class Session:
    id: str
    sequence: Sequence
    open_request_id: str  # the OpenSession request id ("" if none): a retry finds the session by it
    last_used: float
    results: OrderedDict[str, StoredResult] = field(default_factory=OrderedDict)  # request id -> its answer
    inflight: dict[str, Answer] = field(default_factory=dict)  # request id -> its queued or running step (scheduler.PendingStep)
    busy: int = 0  # steps queued or running: a busy session is never reaped
    # OpenSessionRequest.verify_all_drafts: the goodput policy never trims the session's drafts
    # (a drafter being measured, not served); its outcomes still inform the policy
    verify_all_drafts: bool = False
    # OpenSessionRequest.server_drafter: the session's proposer (verifier/server/drafting.py), which
    # the scheduler asks for each step's drafts; None: the client drafts
    drafter: "ServerDrafter | None" = None


class SessionTable:
    def __init__(self, n_slots: int, results_per_session: int, clock=time.monotonic):
        self.n_slots = n_slots
        self.results_per_session = results_per_session
        self.clock = clock
        self.reserved = 0  # slots held by open sessions and by opens in flight
        self._sessions: dict[str, Session] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # session id -> why it is gone
        # OpenSession request id -> (its request's fingerprint, the task admitting it)
        self.opens: dict[str, tuple[Fingerprint, asyncio.Task]] = {}
        self._gone_opens: OrderedDict[str, None] = OrderedDict()  # request ids in opens whose session is gone, oldest first

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def free_slots(self) -> int:
        return self.n_slots - self.reserved

    def reserve(self) -> bool:
        if self.reserved >= self.n_slots:
            return False
        self.reserved += 1
        return True

    def unreserve(self) -> None:
        assert self.reserved > 0, "unreserve without reserve"
        self.reserved -= 1

    def add(self, sequence: Sequence, open_request_id: str = "", verify_all_drafts: bool = False,
            drafter: "ServerDrafter | None" = None) -> Session:
        """Register an admitted sequence (its slot was reserved before the prefill)."""
        session = Session(secrets.token_hex(16), sequence, open_request_id, self.clock(), verify_all_drafts=verify_all_drafts,
                          drafter=drafter)
        self._sessions[session.id] = session
        return session

    def find(self, session_id: str) -> Session | None:
        """The live session, or None."""
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        """The live session; LookupError saying whether it was never known, closed or reaped."""
        session = self._sessions.get(session_id)
        if session is None:
            raise LookupError(self.why_missing(session_id))
        return session

    def why_missing(self, session_id: str) -> str:
        why = self._gone.get(session_id)
        if why is None:
            return f"session_id {session_id!r} is not known to this server"
        return f"session_id {session_id!r} was {why}"

    def is_live(self, session: Session) -> bool:
        return self._sessions.get(session.id) is session

    def remove(self, session_id: str, why: str) -> Session | None:
        """Forget a session and give its slot back to the admission count (the caller releases the
        engine slot on the worker). None when the session is unknown or already gone."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        self.reserved -= 1
        self._gone[session_id] = why
        while len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)
        rid = session.open_request_id
        if rid and rid in self.opens:  # kept for a late duplicate of the open, among the last GONE_REMEMBERED
            self._gone_opens[rid] = None
            while len(self._gone_opens) > GONE_REMEMBERED:
                self.opens.pop(self._gone_opens.popitem(last=False)[0], None)
        return session

    def idle(self, timeout_s: float) -> list[Session]:
        """Sessions unused for timeout_s with no step queued or running."""
        cutoff = self.clock() - timeout_s
        return [s for s in self._sessions.values() if s.busy == 0 and s.last_used <= cutoff]

    def store_result(self, session: Session, request_id: str, fingerprint: Fingerprint, result: rpc.StepResult) -> None:
        """Keep the last `results_per_session` answered steps for idempotent retries."""
        session.results[request_id] = StoredResult(fingerprint, result)
        while len(session.results) > self.results_per_session:
            session.results.popitem(last=False)

    def all(self) -> list[Session]:
        return list(self._sessions.values())
