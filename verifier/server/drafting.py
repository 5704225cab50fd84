"""Server-side drafters: a session opened with OpenSessionRequest.server_drafter gets each step's
drafts from the server, proposed when the step is taken into a batch (its session then sits at
the position the step runs from), from the session's context: its prompt and every token emitted.

  ngram  the project's n-gram proposer (prompt lookup, verifier/proposers/ngram.py): no model.
  mtp    the checkpoint's MTP head (verifier/proposers/mtp.py): fed the prompt's hidden rows at
         open and each step's consumed rows (StepRequest.want_hidden), as generate() feeds it.

Everything here runs on the worker thread (the head's forwards are device work, ordered with the
engine's steps there); the event loop only reads `k` and `wants_hidden`. Each step's drafts are
cut by draft_room, the rule generate() and the drafter's loop use, so a server-drafted session
takes the steps the same proposer takes in process, and no step it drafts runs past the context
or the token budget. Drafts never decide an emitted token (the target's acceptance does), so the
stream equals plain decoding whatever the proposer drafts.
"""

from __future__ import annotations

import logging

from ..engine import Engine, Sequence, StepResult
from ..generation import draft_room
from ..proposers.mtp import MTPProposer
from ..proposers.ngram import NgramProposer

log = logging.getLogger(__name__)

NGRAM, MTP = "ngram", "mtp"


class ServerDrafter:
    """One session's proposer and the context it proposes from."""

    def __init__(self, name: str, k: int, prompt: list[int], seq: Sequence, engine: Engine, mtp_head=None):
        """On the worker, right after engine.open (with want_hidden for "mtp"): k drafts per step."""
        self.name = name
        self.k = k
        self.context = list(prompt) + [seq.pending]  # the prompt, then every emitted token
        self.wants_hidden = name == MTP
        if name == MTP:
            self.proposer = MTPProposer(mtp_head, engine.pool.max_seq_len)
            self.proposer.begin(seq.prompt_hidden)
            seq.prompt_hidden = None  # copied into the proposer: the engine's buffer is not kept
        else:
            self.proposer = NgramProposer()

    def propose(self, seq: Sequence, engine: Engine) -> list[int]:
        """The next step's drafts: at most k, cut to the room the step has (draft_room); none
        once the proposer has failed to observe a step (observe)."""
        if self.proposer is None:
            return []
        room = draft_room(self.k, engine.max_k, engine.pool.max_seq_len, seq.position, seq.max_new_tokens, seq.emitted)
        if room <= 0:
            return []
        return list(self.proposer.propose(self.context, room))[:room]

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
