"""The generation loop every front end uses: open a session, propose drafts, verify, repeat, close.
The design in full: DESIGN.md section 8, "The generation loop".
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import grpc
import numpy as np

from verifier.generation import Generation, draft_room
from verifier.params import SamplingParams
from verifier.proposers import ProbabilityProposer, Proposer

from .adaptive import AdaptiveK
from .messages import ModelInfo, Session, Step, StepOutcome, VerifierError

log = logging.getLogger(__name__)

STREAM, UNARY = "stream", "unary"  # transports: VerifyStream, or one Verify call per step


class DraftLoop:
    """One session's loop state. `next_step()` builds the step to send; `advance(step, outcome)` takes
    its (OK) outcome in and returns the tokens it emitted."""

    def __init__(self, session: Session, info: ModelInfo, proposer: Proposer | None, k: int, max_new_tokens: int,
                 return_logits: bool = False, sampling: SamplingParams = SamplingParams(),
                 adaptive: AdaptiveK | None = None, server_drafter: str = ""):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        check_server_drafting(server_drafter, proposer, k, adaptive)
        self.server_drafter = server_drafter  # "": this loop's proposer drafts
        self.session, self.info, self.proposer = session, info, proposer
        self.k, self.max_new_tokens, self.return_logits = k, max_new_tokens, return_logits
        self.send_probs = not sampling.greedy  # rejection sampling needs q; greedy never sends it
        # decided once: isinstance against a runtime-checkable Protocol walks its members, host work
        # that would otherwise recur every step
        self.gives_probs = isinstance(proposer, ProbabilityProposer)
        self.adaptive = adaptive
        self.position = session.position
        self.tokens = [session.pending]
        self.finish_reason = session.finish_reason
        self.accepted: list[int] = []
        self.drafted: list[int] = []
        self._logits = [session.logits] if return_logits and session.logits is not None else []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_room(self, k: int | None = None) -> int:
        """How many drafts the next step may carry when it asks for k (default: the loop's k)."""
        return draft_room(self.k if k is None else k, self.info.max_k, self.info.max_context, self.position,
                          self.max_new_tokens, len(self.tokens))

    def next_step(self) -> Step:
        drafts, probs = [], None
        if self.proposer is not None and self.k > 0:
            room = self.draft_room(min(self.k, self.adaptive.next_k()) if self.adaptive is not None else self.k)
            if room > 0:
                drafts, probs = self._propose(room)
        return Step(self.session.id, self.position, tuple(drafts), draft_probs=probs, return_logits=self.return_logits)

    def _propose(self, room: int) -> tuple[list[int], np.ndarray | None]:
        context = self.session.prompt_ids + self.tokens
        if not self.gives_probs:
            return list(self.proposer.propose(context, room))[:room], None
        drafts, probs = self.proposer.propose_with_probs(context, room)
        drafts = list(drafts)[:room]
        if probs is None or not self.send_probs or not drafts:
            return drafts, None
        probs = np.asarray(probs, dtype=np.float32)
        if probs.ndim != 2 or probs.shape[0] < len(drafts) or probs.shape[1] != self.info.vocab_size:
            raise ValueError(f"the proposer's draft probabilities have shape {list(probs.shape)}, expected "
                             f"[{len(drafts)}, {self.info.vocab_size}] (one row per draft, the served vocabulary)")
        return drafts, probs[: len(drafts)]

    def advance(self, step: Step, outcome: StepOutcome) -> list[int]:
        outcome.check()
        # A reply that does not fit the step would corrupt the stream silently: refuse it loudly.
        if not outcome.tokens and outcome.finish_reason is None:
            raise _internal(f"step at position {step.expected_position} emitted no tokens and did not finish")
        if outcome.position != step.expected_position + len(outcome.tokens):
            raise _internal(f"step at position {step.expected_position} emitted {len(outcome.tokens)} tokens "
                            f"but moved the session to position {outcome.position}")
        verified = self._verified(step, outcome)
        self.position = outcome.position
        self.tokens += outcome.tokens
        self.finish_reason = outcome.finish_reason
        self.accepted.append(outcome.accepted)
        self.drafted.append(verified)
        if self.adaptive is not None:
            self.adaptive.observe(verified, outcome.accepted)
        if self.return_logits:
            if outcome.logits is None or outcome.logits.shape[0] != len(outcome.tokens):
                raise _internal(f"asked for logits, got {None if outcome.logits is None else outcome.logits.shape} "
                                f"for {len(outcome.tokens)} tokens")
            self._logits.append(outcome.logits)
        return list(outcome.tokens)

    def _verified(self, step: Step, outcome: StepOutcome) -> int:
        """The step's drafts verified, checked against what the step could hold. Runs before the
        loop advances: draft_room() is still the room the step had."""
        if self.server_drafter:
            # the server proposed up to draft_room() drafts (the shared rule); it always says how many it verified
            if outcome.verified_drafts is None:
                raise _internal(f"a step of server drafter {self.server_drafter!r} does not say how many drafts "
                                f"were verified (verified_drafts unset)")
            room = self.draft_room()
            if not outcome.accepted <= outcome.verified_drafts <= room:
                raise _internal(f"accepted {outcome.accepted} and verified {outcome.verified_drafts} server drafts, "
                                f"the step had room for {room} (accepted <= verified_drafts <= room)")
            return outcome.verified_drafts
        verified = outcome.verified(len(step.draft_ids))
        if not outcome.accepted <= verified <= len(step.draft_ids):
            raise _internal(f"accepted {outcome.accepted} and verified {verified} of {len(step.draft_ids)} drafts "
                            f"(accepted <= verified_drafts <= drafts sent)")
        kept = min(outcome.accepted, len(outcome.tokens))
        if list(step.draft_ids[:kept]) != outcome.tokens[:kept]:
            raise _internal(f"accepted {outcome.accepted} of drafts {list(step.draft_ids)}, but the tokens are {outcome.tokens}")
        return verified

    def result(self) -> Generation:
        logits = np.concatenate(self._logits) if self.return_logits and self._logits else None
        return Generation(list(self.tokens), self.finish_reason, list(self.accepted), list(self.drafted), logits,
                          session_id=self.session.id, prompt_ids=list(self.session.prompt_ids))


def check_server_drafting(server_drafter: str, proposer: Proposer | None, k: int, adaptive: AdaptiveK | None) -> None:
    """A server-drafted session has k >= 1 drafts a step (the server reads 0 as its max_k) and
    neither a proposer nor adaptive K on this side (the server drafts, at the k fixed at the open)."""
    if not server_drafter:
        return
    if proposer is not None:
        raise ValueError(f"server drafter {server_drafter!r}: the server proposes the drafts, so pass no proposer")
    if adaptive is not None:
        raise ValueError(f"server drafter {server_drafter!r}: drafts per step are fixed when the session opens, "
                         f"so adaptive K does not apply")
    if k < 1:
        raise ValueError(f"server drafter {server_drafter!r} needs k >= 1 drafts per step, got {k}")


def _internal(message: str) -> VerifierError:
    return VerifierError(grpc.StatusCode.INTERNAL, f"inconsistent reply from the verifier: {message}")


def stream(client, proposer: Proposer | None, *, prompt_ids: list[int] | None = None, text: str | None = None,
           max_new_tokens: int, sampling: SamplingParams = SamplingParams(), k: int = 4, return_logits: bool = False,
           transport: str = STREAM, info: ModelInfo | None = None, adaptive: AdaptiveK | None = None,
           on_open: Callable[[Session], None] | None = None, verify_all_drafts: bool = False,
           server_drafter: str = "") -> Iterator[list[int]]:
    """Generate through a blocking VerifierClient: yields each step's new tokens as they arrive (the
    first token first) and returns the Generation (StopIteration.value; `generate` unwraps it). The
    session is closed at the end, on error, on KeyboardInterrupt and when the caller stops early.
    `on_open(session)` runs once the session is open, before anything is yielded: the place for
    checks that need the server's view of the prompt (a --text prompt's length); what it raises
    closes the session and propagates. `verify_all_drafts`: the session asks the server to verify
    every draft (no goodput trimming), as measuring the drafter needs. `server_drafter`: the
    server drafts k per step (see DESIGN.md section 8, "The generation loop"); `proposer` is then None."""
    if transport not in (STREAM, UNARY):
        raise ValueError(f"transport must be {STREAM!r} or {UNARY!r}, got {transport!r}")
    check_server_drafting(server_drafter, proposer, k, adaptive)  # before a session is opened
    info = info or client.model_info()
    if server_drafter and transport == STREAM:
        return (yield from _run_on_server(client, info, prompt_ids, text, max_new_tokens, sampling, k, return_logits, on_open,
                                          verify_all_drafts, server_drafter))
    session = client.open_session(prompt_ids, text, sampling=sampling, max_new_tokens=max_new_tokens,
                                  return_logits=return_logits, verify_all_drafts=verify_all_drafts,
                                  **_server_drafting(server_drafter, k))
    try:
        if on_open is not None:
            on_open(session)
        loop = DraftLoop(session, info, proposer, k, max_new_tokens, return_logits, sampling, adaptive, server_drafter)
        yield list(loop.tokens)
        steps = client.verify_stream() if transport == STREAM else client
        try:
            while not loop.finished:
                step = loop.next_step()
                yield loop.advance(step, steps.step(step))
        finally:
            if steps is not client:
                steps.close()
        return loop.result()
    finally:
        _close_quietly(lambda: client.close_session(session.id), session.id)


def _run_on_server(client, info: ModelInfo, prompt_ids, text, max_new_tokens: int, sampling: SamplingParams, k: int,
                   return_logits: bool, on_open, verify_all_drafts: bool, server_drafter: str) -> Iterator[list[int]]:
    """`stream` of a server-drafted session as one Generate call: the server steps it; each result is
    checked by the DraftLoop as if this side had sent its step. The call ends (and the server closes
    the session) on every way out."""
    call = client.generate(prompt_ids, text, sampling=sampling, max_new_tokens=max_new_tokens, return_logits=return_logits,
                           verify_all_drafts=verify_all_drafts, server_drafter=server_drafter, server_draft_k=k)
    try:
        if on_open is not None:
            on_open(call.session)
        loop = DraftLoop(call.session, info, None, k, max_new_tokens, return_logits, sampling, None, server_drafter)
        yield list(loop.tokens)
        for outcome in call:
            yield loop.advance(loop.next_step(), outcome)  # next_step: the drafts-free step the server ran
        if not loop.finished:
            raise _internal("the Generate stream ended before its session finished")
        return loop.result()
    finally:
        call.cancel()


def generate(client, proposer: Proposer | None, *, on_tokens: Callable[[list[int]], None] | None = None,
             **kwargs) -> Generation:
    """`stream` to the end; `on_tokens` sees each step's new tokens as they arrive."""
    tokens = stream(client, proposer, **kwargs)
    while True:
        try:
            chunk = next(tokens)
        except StopIteration as done:
            return done.value
        if on_tokens is not None:
            on_tokens(chunk)


async def agenerate(client, proposer: Proposer | None, *, prompt_ids: list[int] | None = None, text: str | None = None,
                    max_new_tokens: int, sampling: SamplingParams = SamplingParams(), k: int = 4, return_logits: bool = False,
                    transport: str = STREAM, info: ModelInfo | None = None,
                    on_tokens: Callable[[list[int]], None] | None = None, adaptive: AdaptiveK | None = None,
                    verify_all_drafts: bool = False, server_drafter: str = "") -> Generation:
    """The same loop through an AsyncVerifierClient."""
    if transport not in (STREAM, UNARY):
        raise ValueError(f"transport must be {STREAM!r} or {UNARY!r}, got {transport!r}")
    check_server_drafting(server_drafter, proposer, k, adaptive)
    info = info or await client.model_info()
    session = await client.open_session(prompt_ids, text, sampling=sampling, max_new_tokens=max_new_tokens,
                                        return_logits=return_logits, verify_all_drafts=verify_all_drafts,
                                        **_server_drafting(server_drafter, k))
    try:
        loop = DraftLoop(session, info, proposer, k, max_new_tokens, return_logits, sampling, adaptive, server_drafter)
        if on_tokens is not None:
            on_tokens(list(loop.tokens))
        steps = client.verify_stream() if transport == STREAM else client
        try:
            while not loop.finished:
                step = loop.next_step()
                new = loop.advance(step, await steps.step(step))
                if on_tokens is not None:
                    on_tokens(new)
        finally:
            if steps is not client:
                await steps.close()
        return loop.result()
    finally:
        try:
            await client.close_session(session.id)
        except VerifierError as err:
            log.warning("could not close session %s: %s (the server reaps it when idle)", session.id, err)


def _server_drafting(server_drafter: str, k: int) -> dict:
    """OpenSession's server drafting fields: none when the client drafts."""
    return {"server_drafter": server_drafter, "server_draft_k": k} if server_drafter else {}


def _close_quietly(close: Callable[[], object], session_id: str) -> None:
    # Closing runs on every way out, errors included: a failed close must not hide the error that
    # got us here, and an unclosed session is reaped by the server once idle.
    try:
        close()
    except VerifierError as err:
        log.warning("could not close session %s: %s (the server reaps it when idle)", session_id, err)
