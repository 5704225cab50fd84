"""Many sessions from one client, one request per round for all of them.
The design in full: DESIGN.md section 8, "Many sessions from one client".
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import grpc

from verifier.generation import Generation
from verifier.params import SamplingParams
from verifier.proposers import Proposer

from .adaptive import AdaptiveK
from .aio_client import AsyncVerifierClient
from .aio_client import carry_out as carry_out_async
from .client import VerifierClient, carry_out
from .loop import DraftLoop
from .messages import ModelInfo, Step, StepOutcome, VerifierError

log = logging.getLogger(__name__)

CONCURRENT_CALLS = 16  # the blocking fleet's opens or closes of one action in flight at once


@dataclass(frozen=True)
class Job:
    """One generation for a lane: what to open, and how its loop drafts."""

    max_new_tokens: int
    prompt_ids: list[int] | None = None
    text: str | None = None  # tokenized by the server, instead of prompt_ids
    proposer: Proposer | None = None  # None: plain decoding
    k: int = 0  # drafts per step asked of the proposer (the loop cuts to the server's limits)
    sampling: SamplingParams = SamplingParams()
    return_logits: bool = False
    verify_all_drafts: bool = False  # the server never trims this generation's drafts (a measurement)
    adaptive: AdaptiveK | None = None
    max_steps: int | None = None  # cut the generation after this many verify steps (None: to its end)

    def __post_init__(self):
        if (self.prompt_ids is None) == (self.text is None):
            raise ValueError("a Job needs exactly one of prompt_ids and text")
        if self.max_new_tokens < 1 or self.k < 0 or (self.max_steps is not None and self.max_steps < 1):
            raise ValueError(f"a Job needs max_new_tokens >= 1, k >= 0 and max_steps >= 1 or None, got "
                             f"{self.max_new_tokens}, {self.k}, {self.max_steps}")

    def open_arguments(self) -> dict:
        """Keyword arguments of either client's open_session."""
        return {"prompt_ids": self.prompt_ids, "text": self.text, "sampling": self.sampling,
                "max_new_tokens": self.max_new_tokens, "return_logits": self.return_logits,
                "verify_all_drafts": self.verify_all_drafts}


@dataclass
class Ended:
    """How a lane's generation ended; the workload hears it before the lane asks for its next job."""

    lane: int
    job: Job
    generation: Generation | None  # what the loop emitted, partial when cut or failed; None: never opened
    error: Exception | None = None  # a VerifierError, or what the proposer raised
    cut: bool = False  # stopped by the job's max_steps or the fleet's deadline before it finished


@dataclass(frozen=True)
class Round:
    index: int
    seconds: float  # the round's request (VerifyRounds message or Verify call), its retries included
    steps: int  # steps sent (one per unfinished session)
    tokens: int  # emitted by the round's OK steps
    proposing: float = 0.0  # the proposers' time: every session's next_step of the round, seconds
    # the request's first step's request id, as its answer carried it ("" when the whole request
    # failed): the server's --round-timings names the request by it (verifier/server/timings.py)
    request_id: str = ""


class Workload(Protocol):
    def next_job(self, lane: int) -> Job | None: ...

    def ended(self, report: Ended) -> None: ...


# What the driver asks its transport to do, and what each is answered with.
@dataclass(frozen=True)
class OpenSessions:
    jobs: tuple[Job, ...]  # answer: [Session | VerifierError], one per job


@dataclass(frozen=True)
class VerifyRound:
    steps: tuple[Step, ...]  # answer: [StepOutcome] one per step, or the VerifierError of the whole call


@dataclass(frozen=True)
class CloseSessions:
    session_ids: tuple[str, ...]  # answer: [bool | VerifierError], one per session


@dataclass
class _Lane:
    job: Job
    loop: DraftLoop
    steps: int = 0


@dataclass
class Fleet:
    workload: Workload
    lanes: int
    info: ModelInfo
    deadline: float | None = None  # time.time() after which no step is sent and every lane is cut
    # hears each round once its outcomes are in its sessions, before the sessions it ended are closed
    on_round: Callable[[Round], None] | None = None
    rounds: list[Round] = field(default_factory=list)
    close_errors: list[VerifierError] = field(default_factory=list)
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self):
        if self.lanes < 1:
            raise ValueError(f"a fleet needs at least one lane, got {self.lanes}")
        self._live: dict[int, _Lane] = {}
        self._free: list[int] = list(range(self.lanes))

    def open_session_ids(self) -> tuple[str, ...]:
        """Sessions still open: none once `decisions` has returned; the drivers close them on an error."""
        return tuple(lane.loop.session.id for lane in self._live.values())

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline

    def decisions(self):
        """The whole run, as decisions for a transport to carry out; returns when every lane is done."""
        while True:
            yield from self._fill()
            if not self._live:
                return
            if self._past_deadline():
                yield from self._end([(lane, None, True) for lane in self._live])
            else:
                yield from self._round()

    def _fill(self):
        """Ask every free lane for a job and open them, until no free lane wants one."""
        while self._free and not self._past_deadline():
            asked = [(lane, job) for lane in self._free if (job := self.workload.next_job(lane)) is not None]
            self._free = []  # a lane that got no job is done for good
            if not asked:
                return
            opened = yield OpenSessions(tuple(job for _, job in asked))
            finished_at_open = []
            for (lane, job), got in zip(asked, opened):
                if isinstance(got, VerifierError):
                    self._report(Ended(lane, job, None, got), lane)
                    continue
                self._live[lane] = _Lane(job, DraftLoop(got, self.info, job.proposer, job.k, job.max_new_tokens,
                                                        job.return_logits, job.sampling, job.adaptive))
                if self._live[lane].loop.finished:  # the first token already ended it
                    finished_at_open.append((lane, None, False))
            yield from self._end(finished_at_open)

    def _round(self):
        """One request with the next step of every live session; settle each outcome on its own."""
        ending: list[tuple[int, Exception | None, bool]] = []
        sent: list[tuple[int, Step]] = []
        proposed_from = self.clock()
        for lane, state in self._live.items():
            try:
                sent.append((lane, state.loop.next_step()))
            except Exception as err:  # the proposer is the caller's code: its failure ends its session only
                ending.append((lane, err, False))
        tokens = 0
        if sent:
            start = self.clock()
            proposing = start - proposed_from
            got = yield VerifyRound(tuple(step for _, step in sent))
            seconds = self.clock() - start
            outcomes = [got] * len(sent) if isinstance(got, VerifierError) else got
            request_id = "" if isinstance(outcomes[0], VerifierError) else outcomes[0].request_id
            for (lane, step), outcome in zip(sent, outcomes):
                state = self._live[lane]
                try:
                    tokens += len(state.loop.advance(step, _checked(outcome)))
                except VerifierError as err:
                    ending.append((lane, err, False))
                    continue
                state.steps += 1
                if state.loop.finished:
                    ending.append((lane, None, False))
                elif state.job.max_steps is not None and state.steps >= state.job.max_steps:
                    ending.append((lane, None, True))
        if sent:  # heard before the round's ended sessions are closed: closing them is not the round's time
            done = Round(len(self.rounds), seconds, len(sent), tokens, proposing, request_id)
            self.rounds.append(done)
            if self.on_round is not None:
                self.on_round(done)
        yield from self._end(ending)

    def _end(self, ending: list[tuple[int, Exception | None, bool]]):
        """Close the sessions of these lanes (lane, error, cut), report them, free the lanes."""
        if not ending:
            return
        closed = yield CloseSessions(tuple(self._live[lane].loop.session.id for lane, _, _ in ending))
        for got in closed:
            if isinstance(got, VerifierError):  # the server reaps an unclosed session once it is idle
                log.warning("could not close a session: %s", got)
                self.close_errors.append(got)
        for lane, error, cut in ending:
            state = self._live.pop(lane)
            self._report(Ended(lane, state.job, state.loop.result(), error, cut), lane)

    def _report(self, report: Ended, lane: int) -> None:
        self.workload.ended(report)
        self._free.append(lane)


def _checked(outcome: StepOutcome | VerifierError) -> StepOutcome:
    if isinstance(outcome, VerifierError):  # the whole request failed: every step of the round did
        raise outcome
    return outcome


# -- the transports ---------------------------------------------------------------------------


class _Blocking:
    """Carries out actions with blocking calls; VerifierErrors come back as answers. The opens or
    closes of one action run concurrently (threads: a blocking channel serves calls from many), so a
    round that ends sixteen sessions waits for one close, not sixteen in turn. Rounds go on one
    VerifyRounds stream (a Verify call per round pays a call's setup on the server every round, a
    stream once: `python -m bench.server_overhead` measures both, four callers of 16 sessions on a
    loopback server with no model, as its unary_x4 and rounds_x4 shapes, `server_overhead_2026-11-30.json`),
    or as Verify calls with `rounds_stream` off or when the server does not serve VerifyRounds
    (UNIMPLEMENTED: a server from before it)."""

    def __init__(self, client: VerifierClient, rounds_stream: bool):
        self.client = client
        self.rounds = client.verify_rounds() if rounds_stream else None
        self._calls: ThreadPoolExecutor | None = None  # the concurrent opens and closes, made at the first

    def __call__(self, action):
        client = self.client
        if isinstance(action, VerifyRound):
            return _caught(self._verify, list(action.steps))
        if isinstance(action, OpenSessions):
            return self._each([lambda job=job: client.open_session(**job.open_arguments()) for job in action.jobs])
        return self._each([lambda session_id=session_id: client.close_session(session_id) for session_id in action.session_ids])

    def _each(self, calls: list) -> list:
        """Every call's answer (or the VerifierError it raised), in order; more than one at a time."""
        if len(calls) <= 1:
            return [_caught(call) for call in calls]
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=CONCURRENT_CALLS, thread_name_prefix="fleet-call")
        return list(self._calls.map(_caught, calls))

    def _verify(self, steps: list[Step]) -> list[StepOutcome]:
        if self.rounds is not None:
            try:
                return self.rounds.verify(steps)
            except VerifierError as err:
                if err.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("the server does not serve VerifyRounds; one Verify call per round from now on")
                self.rounds = None
        return self.client.verify(steps)

    def close(self) -> None:
        if self._calls is not None:
            self._calls.shutdown()
        if self.rounds is not None:
            self.rounds.close()


def _caught(call, *args) -> object:
    try:
        return call(*args)
    except VerifierError as err:
        return err


async def _concurrent(client: AsyncVerifierClient, action):
    """Carry out one action on the event loop; the opens or closes of one action run concurrently."""
    if isinstance(action, VerifyRound):
        return await _acaught(client.verify(list(action.steps)))
    if isinstance(action, OpenSessions):
        return await asyncio.gather(*(_acaught(client.open_session(**job.open_arguments())) for job in action.jobs))
    return await asyncio.gather(*(_acaught(client.close_session(session_id)) for session_id in action.session_ids))


async def _acaught(call) -> object:
    try:
        return await call
    except VerifierError as err:
        return err


def run_fleet(client: VerifierClient, workload: Workload, lanes: int, *, info: ModelInfo | None = None,
              deadline: float | None = None, on_round: Callable[[Round], None] | None = None,
              rounds_stream: bool = True) -> Fleet:
    """Run the workload's jobs on `lanes` sessions at a time through a blocking client; the Fleet
    returned holds the rounds and the close errors. Sessions still open on any way out are closed.
    `rounds_stream`: the rounds go on one VerifyRounds stream (else one Verify call each)."""
    fleet = Fleet(workload, lanes, info or client.model_info(), deadline, on_round)
    transport = _Blocking(client, rounds_stream)
    try:
        carry_out(fleet.decisions(), transport)
    finally:
        try:
            transport(CloseSessions(fleet.open_session_ids()))
        finally:
            transport.close()
    return fleet


async def arun_fleet(client: AsyncVerifierClient, workload: Workload, lanes: int, *,
                     info: ModelInfo | None = None, deadline: float | None = None,
                     on_round: Callable[[Round], None] | None = None) -> Fleet:
    """`run_fleet` through an AsyncVerifierClient."""
    fleet = Fleet(workload, lanes, info or await client.model_info(), deadline, on_round)
    try:
        await carry_out_async(fleet.decisions(), lambda action: _concurrent(client, action))
    finally:
        await _concurrent(client, CloseSessions(fleet.open_session_ids()))
    return fleet


__all__ = ["Job", "Ended", "Round", "Workload", "Fleet", "OpenSessions", "VerifyRound", "CloseSessions", "run_fleet",
           "arun_fleet"]
