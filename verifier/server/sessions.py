"""Sessions: a sequence in a slot, seen from the wire.
The design in full: DESIGN.md section 8, "Sessions".
"""

from __future__ import annotations

import asyncio
import collections
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
RELEASES_TIMED = 32  # recent slot releases whose spacing estimates the wait for a slot (expected_wait_s)
FULL, OVER_QUOTA = "full", "over quota"  # why `reserve` refused


class StoredResult(NamedTuple):  # a tuple: one is made per answered step with a request id
    fingerprint: Fingerprint  # of the request that produced it: a retry must match
    result: rpc.StepResult


@dataclass(eq=False)
class Session:
    id: str
    sequence: Sequence
    principal: str  # who opened it (verifier/server/principals.py): no one else can see or step it
    open_request_id: str  # the OpenSession request id ("" if none): a retry finds the session by it
    last_used: float  # admission, then the last step answered OK: the reaper's clock starts here
    results: OrderedDict[str, StoredResult] = field(default_factory=OrderedDict)  # request id -> its answer
    inflight: dict[str, Answer] = field(default_factory=dict)  # request id -> its queued or running step (scheduler.PendingStep)
    busy: int = 0  # steps queued or running: a busy session is never reaped
    # OpenSessionRequest.verify_all_drafts: the goodput policy never trims the session's drafts
    # (a drafter being measured, not served); its outcomes still inform the policy
    verify_all_drafts: bool = False
    # OpenSessionRequest.server_drafter: the session's proposer (verifier/server/drafting.py), which
    # the scheduler asks for each step's drafts; None: the client drafts
    drafter: "ServerDrafter | None" = None
    # with cohorts (verifier/server/scheduler.py): which cohort's batches the session's steps run in
    # (-1: none yet, given at its first batch)
    cohort: int = -1


OpenKey = tuple[str, str]  # (principal, OpenSession request id)


class SessionTable:
    def __init__(self, n_slots: int, results_per_session: int, clock=time.monotonic, max_per_principal: int = 0):
        """max_per_principal: the most slots one principal may hold at once (0: no cap but n_slots)."""
        self.n_slots = n_slots
        self.results_per_session = results_per_session
        self.max_per_principal = max_per_principal
        self.clock = clock
        self.reserved = 0  # slots held by open sessions and by opens in flight
        self.held: dict[str, int] = {}  # principal -> its share of `reserved`
        self._releases: collections.deque[float] = collections.deque(maxlen=RELEASES_TIMED)  # clock() of recent releases
        self._sessions: dict[str, Session] = {}
        self._gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # session id -> (its principal, why it is gone)
        # (principal, OpenSession request id) -> (its request's fingerprint, the task admitting it)
        self.opens: dict[OpenKey, tuple[Fingerprint, asyncio.Task]] = {}
        self._gone_opens: OrderedDict[OpenKey, None] = OrderedDict()  # keys in opens whose session is gone, oldest first

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def free_slots(self) -> int:
        return self.n_slots - self.reserved

    def reserve(self, principal: str) -> str | None:
        """Hold a slot for an open of `principal`: None, or why not (FULL, OVER_QUOTA)."""
        held = self.held.get(principal, 0)
        if self.max_per_principal and held >= self.max_per_principal:
            return OVER_QUOTA
        if self.reserved >= self.n_slots:
            return FULL
        self.reserved += 1
        self.held[principal] = held + 1
        return None

    def unreserve(self, principal: str) -> None:
        assert self.reserved > 0 and self.held.get(principal, 0) > 0, "unreserve without reserve"
        self.reserved -= 1
        self.held[principal] -= 1
        if not self.held[principal]:
            del self.held[principal]
        self._releases.append(self.clock())

    def expected_wait_s(self) -> float | None:
        """The mean spacing of the recent slot releases (closes, reaps, failed opens): the expected
        wait for the next one, or None before two releases were seen."""
        if len(self._releases) < 2:
            return None
        return (self._releases[-1] - self._releases[0]) / (len(self._releases) - 1)

    def add(self, sequence: Sequence, principal: str, open_request_id: str = "", verify_all_drafts: bool = False,
            drafter: "ServerDrafter | None" = None) -> Session:
        """Register an admitted sequence (its slot was reserved for `principal` before the prefill)."""
        session = Session(secrets.token_hex(16), sequence, principal, open_request_id, self.clock(),
                          verify_all_drafts=verify_all_drafts, drafter=drafter)
        self._sessions[session.id] = session
        return session

    def find(self, session_id: str, principal: str) -> Session | None:
        """The live session if `principal` owns it, else None (another's session does not exist for it)."""
        found = self._sessions.get(session_id)
        return found if found is not None and found.principal == principal else None

    def get(self, session_id: str, principal: str) -> Session:
        """`find`, or LookupError saying whether it was never known (to this principal), closed or reaped."""
        session = self.find(session_id, principal)
        if session is None:
            raise LookupError(self.why_missing(session_id, principal))
        return session

    def why_missing(self, session_id: str, principal: str) -> str:
        gone = self._gone.get(session_id)
        if gone is None or gone[0] != principal:
            return f"session_id {session_id!r} is not known to this server"
        return f"session_id {session_id!r} was {gone[1]}"

    def is_live(self, session: Session) -> bool:
        return self._sessions.get(session.id) is session

    def remove(self, session_id: str, why: str) -> Session | None:
        """Forget a session and give its slot back to the admission count (the caller releases the
        engine slot on the worker). None when the session is unknown or already gone."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        self.unreserve(session.principal)
        self._gone[session_id] = (session.principal, why)
        while len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)
        key = (session.principal, session.open_request_id)
        if key[1] and key in self.opens:  # kept for a late duplicate of the open, among the last GONE_REMEMBERED
            self._gone_opens[key] = None
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
