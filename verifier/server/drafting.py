"""Server-side drafters: a session opened with OpenSessionRequest.server_drafter gets each step's
drafts from the server, proposed when the step is taken into a batch (its session then sits at
the position the step runs from), from the session's context: its prompt and every token emitted.
The design in full: DESIGN.md section 9, "Server-side drafters".
"""

from __future__ import annotations

import logging

from ..engine import Engine, Sequence, StepResult
from ..generation import draft_room
from ..proposers.mtp import MTPAsk, MTPDrafter
from ..proposers.ngram import NgramProposer

log = logging.getLogger(__name__)

NGRAM, MTP = "ngram", "mtp"


class ServerDrafter:
    """One session's proposer and the context it proposes from."""

    def __init__(self, name: str, k: int, prompt: list[int], seq: Sequence, engine: Engine,
                 mtp: MTPDrafter | None = None):
        """On the worker, right after engine.open (with want_hidden for "mtp"): k drafts per step.
        mtp: the server's MTPDrafter (the sequence's slot seq.slot is its slot there too)."""
        self.name = name
        self.k = k
        self.context = list(prompt) + [seq.pending]  # the prompt, then every emitted token
        self.wants_hidden = name == MTP
        if name == MTP:
            if mtp is None:
                raise ValueError("server_drafter 'mtp' needs the server's MTP drafter (the checkpoint's MTP head)")
            self.proposer = mtp.proposer(seq.slot, seq.sampling)  # coupled drafts for sampled sessions
            self.proposer.begin(seq.prompt_hidden)
            seq.prompt_hidden = None  # the proposer holds it until its first proposal feeds it
        else:
            self.proposer = NgramProposer()
        self.ahead = None  # scheduler.Ahead: the next step's drafts, proposed after the last step (read on the event loop)

    def room(self, seq: Sequence, engine: Engine) -> int:
        """Drafts the next step may carry (draft_room); 0 once the proposer has failed to observe a
        step (observe)."""
        if self.proposer is None:
            return 0
        return draft_room(self.k, engine.max_k, engine.max_seq_len, seq.position, seq.max_new_tokens, seq.emitted)

    def mtp_ask(self, room: int) -> tuple[MTPDrafter, MTPAsk]:
        """An MTP session's request for `room` drafts, and the (shared) MTPDrafter to propose it with."""
        return self.proposer.drafter, self.proposer.ask(self.context, room)

    def observe(self, result: StepResult) -> None:
        """An OK step of the session: its emitted tokens extend the context, and the MTP head gets
        its consumed rows' hidden rows (one per emitted token). It runs inside the batch's engine
        job, after the engine has advanced every sequence: a proposer that fails here must not fail
        the batch (its accepted tokens would be lost), so it stops drafting and the session goes on
        as plain decoding (the same stream)."""
        self.context.extend(result.tokens)
        if self.wants_hidden and self.proposer is not None:
            hidden, result.hidden = result.hidden, None
            try:
                self.proposer.observe(hidden)
            except Exception:
                log.exception("server drafter %r failed to observe a step: its session drafts no more", self.name)
                self.proposer = None


def propose_all(drafters: list[ServerDrafter], seqs: list[Sequence], engine: Engine) -> list[list[int] | Exception]:
    """On the worker: the next drafts of each session (drafters[i] proposing for seqs[i]), or the
    exception its proposal raised (which fails that step alone). The n-gram sessions propose one
    by one; the MTP sessions together, through their shared MTPDrafter (DESIGN.md section 9, "Server-side drafters")."""
    out: list[list[int] | Exception] = [[] for _ in drafters]
    asks: dict[int, tuple[MTPDrafter, MTPAsk]] = {}  # session index -> (its MTPDrafter, its ask)
    for i, (drafter, seq) in enumerate(zip(drafters, seqs)):
        try:
            room = drafter.room(seq, engine)
            if room <= 0:
                continue
            if drafter.name == MTP:
                asks[i] = drafter.mtp_ask(room)
            else:
                out[i] = list(drafter.proposer.propose(drafter.context, room))[:room]
        except Exception as exc:  # noqa: BLE001 - answered as that step's INTERNAL error
            out[i] = exc
    for mtp in {id(shared): shared for shared, _ in asks.values()}.values():  # the server's one
        mine = [i for i, (shared, _) in asks.items() if shared is mtp]
        try:
            proposed = mtp.propose([asks[i][1] for i in mine])  # each ask's failure is its own result
        except Exception as exc:  # noqa: BLE001 - a bug outside any one ask: those steps fail, the batch runs
            proposed = [exc] * len(mine)
        for i, result in zip(mine, proposed):
            # an ask of k drafts gets at most k: the cut keeps the rule in one place for every drafter
            out[i] = result if isinstance(result, Exception) else list(result[0])[: asks[i][1].k]
    return out
