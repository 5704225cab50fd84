"""The scheduler: steps from every Verify, VerifyStream and VerifyRounds call wait in one queue; a
batcher task takes everything waiting (up to max_batch_rows verify rows, each session at most once)
and runs ONE engine step for it on the worker thread, then the next. How rows are counted, how a
batch gathers, goodput trimming, when steps are checked, server-side drafters, withdrawal and
shutdown: DESIGN.md section 9, "The scheduler".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from dataclasses import dataclass

import grpc
import torch

from .. import rpc
from ..engine import LENGTH, Engine, StepError, StepRequest
from .answer import Answer
from .convert import STEP_ERROR_CODES, code_name, error_result, logits_message, ok_result
from .drafting import propose_all
from .goodput import GoodputPolicy
from .metrics import Metrics
from .prefill import PromptTurns
from .retries import Fingerprint
from .sessions import Session, SessionTable
from .timings import RoundTimings
from .worker import Worker

log = logging.getLogger(__name__)

# The gather window adapts to the drafters: GATHER_MARGIN x the time they take to come back, never
# below max_wait_ms, never above the last engine step's time nor MAX_GATHER_S (a session that stops
# stepping costs one window).
GATHER_MARGIN = 1.5
MAX_GATHER_S = 0.05


class PendingStep(Answer):
    """One step from its arrival to its result (an rpc.StepResult). A Verify call or a VerifyRounds
    request waits once for all of its steps (service.RequestAnswer counts them down), a VerifyStream
    for the step at the head of its stream; the batch answers a step by `finish`."""

    __slots__ = ("step", "request_id", "session", "drafts", "draft_probs", "fingerprint", "arrived", "rows", "least",
                 "waiters", "taken", "batch")

    def __init__(self, step: rpc.VerifyStep, request_id: str, session: Session | None, drafts: list[int] | None,
                 draft_probs: torch.Tensor | None, fingerprint: Fingerprint | None, arrived: float,
                 result: rpc.StepResult | None = None):
        super().__init__(result)
        self.step = step
        self.request_id = request_id  # step.request_id, read off the wire once
        self.session = session
        self.drafts = drafts
        self.draft_probs = draft_probs  # [K, vocab] float32
        self.fingerprint = fingerprint  # with a request id: what a retry must repeat
        self.arrived = arrived  # time.perf_counter() when its request arrived
        # verify rows it asks for; a server-drafted step's drafts come later (fill): its session's k until then
        self.rows = len(drafts) + 1 if drafts is not None else session.drafter.k + 1
        self.least = self.rows  # rows it holds in a batch at the least (1 where the policy may trim it: Scheduler.submit)
        self.waiters = 1  # callers awaiting this step (an in-flight retry joins the original)
        self.taken = result is not None  # handed to a batch (or answered at once): it completes whatever its callers do
        self.batch = 0  # with round timings on: the index of the batch it ran in (0: none)

    def fill(self, drafts: list[int]) -> None:
        """A server-drafted step's drafts, from its session's proposer: its rows as sent from now on."""
        self.drafts = drafts
        self.rows = len(drafts) + 1
        if self.least > 1:  # not trimmable: its least rows are its rows
            self.least = self.rows

    def forget_callers(self) -> None:
        self._callbacks = []

    def withdraw(self, scheduler: "Scheduler") -> None:
        """Its caller went away: scheduler.withdraw (a stream withdraws a PendingStep or a
        RequestAnswer alike)."""
        scheduler.withdraw(self)


class Scheduler:
    def __init__(self, engine: Engine, worker: Worker, sessions: SessionTable, metrics: Metrics,
                 max_batch_rows: int, max_wait_ms: float, policy: GoodputPolicy | None = None,
                 timings: RoundTimings | None = None, cohorts: int = 1, prompts: PromptTurns | None = None):
        """prompts: the opens' prompt turns; with their step_rows, each batch takes the waiting
        prompts' next pieces into its step, and the batcher runs their turns while no batch comes
        (DESIGN.md section 9, "Prompts inside a step")."""
        if cohorts < 1:
            raise ValueError(f"cohorts must be at least 1, got {cohorts}")
        self.engine = engine
        self.worker = worker
        self.sessions = sessions
        self.metrics = metrics
        # a batch past the largest graph bucket would run eagerly (None: the engine is not graphed)
        self.max_batch_rows = min(max_batch_rows, engine.max_graph_rows or math.inf)
        self.max_wait_s = max_wait_ms / 1000.0
        self.policy = policy
        self._queue: list[PendingStep] = []
        self._queued_rows = 0  # the queued steps' least rows: what the next batch runs at the least
        self._awaited: set[str] = set()  # sessions of the last batch whose next step is not queued yet
        self._wakeup = asyncio.Event()
        self._stopping = False  # begin_stop: no gather window; steps still come and run
        self._ending = False  # stop: the batcher ends once its queue is empty
        self._task: asyncio.Task | None = None
        self._last_answered: float | None = None  # when the last batch's results went out (perf_counter)
        self._round_trip_s = 0.0  # decayed time from a batch's results to its awaited sessions' next steps
        self._last_step_s = 0.0  # how long the last engine step took (the gather window's ceiling)
        self._cut_short = False  # the last batch left steps queued for want of rows (max_batch_rows)
        self._bookkeeping: tuple | None = None  # the last batch's outcomes, until keep_books records them
        self._running: list[PendingStep] = []  # the steps of the batch on the engine now
        self.timings = timings  # None: no per-batch timestamps are kept (the default)
        # Cohorts (DESIGN.md section 9, "The scheduler"): the sessions split into this many groups whose
        # batches take turns, so one group's results go out and its next steps come in while another's
        # step runs. 1: every waiting session in every batch.
        self.cohorts = cohorts
        self._members: list[dict[str, Session]] = [{} for _ in range(cohorts)]  # cohort -> its sessions by id
        self._turn = 0  # the cohort whose batch runs next
        # the prompt turns whose waiting opens the batches take in (None: they run turns of their own)
        self.prompts = prompts if prompts is not None and prompts.step_rows else None
        if self.prompts is not None:
            self.prompts.on_waiting = self._wakeup.set

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._batcher(), name="verifier-batcher")

    def begin_stop(self) -> None:
        """The server is stopping: no batch waits for awaited sessions any more; what is queued runs,
        and so does every step submitted after (the batcher runs on until `stop`)."""
        self._stopping = True
        self._wakeup.set()

    async def stop(self) -> None:
        """Run what is still queued, then end the batcher (no call can submit any more: gRPC has stopped)."""
        self.begin_stop()
        self._ending = True
        if self._task is not None:
            await self._task
        self.keep_books()

    def cut(self, message: str) -> None:
        """The grace period ran out: every step not yet answered (queued, or in the engine step now
        running) is answered UNAVAILABLE with `message` at the position it expected; queued steps
        leave the queue. A running step still completes on the engine (its session goes with the
        server), its late result is dropped."""
        now = self.sessions.clock()
        queued, self._queue, self._queued_rows = self._queue, [], 0
        for pending in queued:
            self._deliver(pending, error_result(pending.step, grpc.StatusCode.UNAVAILABLE, message,
                                                pending.step.expected_position), now)
        for pending in self._running:
            if pending.result is None:  # its release comes when the engine step returns (_deliver)
                self.metrics.record_error(grpc.StatusCode.UNAVAILABLE.name)
                pending.finish(error_result(pending.step, grpc.StatusCode.UNAVAILABLE, message,
                                            pending.step.expected_position))

    @staticmethod
    def answered(step: rpc.VerifyStep, result: rpc.StepResult) -> PendingStep:
        """A step answered without the engine (a request error, a stored result)."""
        return PendingStep(step, step.request_id, None, [], None, None, 0.0, result)

    def submit(self, step: rpc.VerifyStep, request_id: str, session: Session, drafts: list[int] | None,
               draft_probs: torch.Tensor | None, fingerprint: Fingerprint | None, arrived: float) -> PendingStep:
        """Queue a step; `arrived` (perf_counter) is its request's.
        `drafts` None: the session's server-side drafter proposes them when a batch takes the step."""
        pending = PendingStep(step, request_id, session, drafts, draft_probs, fingerprint, arrived)
        if self.policy is not None and not session.verify_all_drafts:
            pending.least = 1  # the policy may verify none of its drafts
        session.busy += 1
        if request_id:
            session.inflight[request_id] = pending
        queue = self._queue
        queue.append(pending)
        self._queued_rows += pending.least
        awaited = self._awaited
        awaited.discard(session.id)
        # the batcher waits for a first step, or for the batch to be whole (_ready, inlined: this runs per step)
        if len(queue) == 1 or not awaited or self._queued_rows >= self.max_batch_rows or self._stopping:
            self._wakeup.set()
        return pending

    def forget(self, session_id: str) -> None:
        """A session closed or reaped: no batch waits for it, its cohort loses it, the policy drops its rates."""
        self._awaited.discard(session_id)
        for members in self._members:
            members.pop(session_id, None)
        if self.policy is not None:
            self.policy.forget(session_id)
        if not self._awaited:
            self._wakeup.set()

    @staticmethod
    def join(pending: PendingStep) -> PendingStep:
        """A retry of a step still queued or running waits for the same result."""
        pending.waiters += 1
        return pending

    def withdraw(self, pending: PendingStep) -> None:
        """A caller of `pending` went away. A step no one waits for leaves the queue, unless a batch
        has taken it (then it completes and its result is stored)."""
        if pending.taken or pending.result is not None:
            return
        pending.waiters -= 1
        if pending.waiters > 0:
            return
        self._queue.remove(pending)
        self._queued_rows -= pending.least
        self._release(pending)
        pending.forget_callers()

    @staticmethod
    def _release(pending: PendingStep, answered_ok_at: float | None = None) -> None:
        """The step no longer holds its session; answered_ok_at: the session table's clock when it
        was answered OK (the session's idle time starts again), None for any other end."""
        session = pending.session
        session.busy -= 1
        if answered_ok_at is not None:
            session.last_used = answered_ok_at
        rid = pending.request_id
        if rid and session.inflight.get(rid) is pending:
            del session.inflight[rid]

    async def _batcher(self) -> None:
        while True:
            all_came = None  # whether the awaited sessions came within the window (None: no wait)
            if not self._queue:
                prompts_wait = self.prompts is not None and self.prompts.waiting
                if self._ending and not prompts_wait:
                    return
                if not prompts_wait:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                # prompts wait: the next batch takes them in, so first the window for its sessions
                if self.max_wait_s > 0 and self._awaited and not self._stopping:
                    all_came = await self._gather()
                if not self._queue:  # no batch came: the prompts take a turn of their own
                    await self.prompts.turn()
                    continue
            elif self.max_wait_s > 0 and not self._ready():
                all_came = await self._gather()
            self._observe_turnaround(all_came)
            batch = self._take()
            self._awaited = set()
            try:
                await self._run(batch)
            except Exception:  # an engine failure must not kill the batcher or strand callers
                log.exception("engine step failed")
                self._awaited = set()
                now = self.sessions.clock()
                for pending in batch:
                    if pending.result is None and pending.taken:  # not one put back in the queue (_put_back)
                        self._deliver(pending, error_result(pending.step, grpc.StatusCode.INTERNAL, "the engine step failed; "
                                                            "see the server log", pending.session.sequence.position), now)

    def _ready(self) -> bool:
        """The next batch may run: every awaited session has queued its step, or the batch is full."""
        return not self._awaited or self._queued_rows >= self.max_batch_rows or self._stopping

    def gather_window_s(self) -> float:
        """How long the next batch waits for the awaited sessions: max_wait_ms, or GATHER_MARGIN x the
        decayed time they took to come back (drafters that take longer than max_wait_ms between a
        result and their next step, a slower host or a model drafter, would otherwise split every
        round into fragments), but never longer than the last engine step took (a fragment costs
        about one more step: waiting longer than that for a straggler costs the others more than
        running without it) nor MAX_GATHER_S."""
        return max(self.max_wait_s, min(MAX_GATHER_S, GATHER_MARGIN * self._round_trip_s, self._last_step_s))

    async def _gather(self) -> bool:
        """Wait up to the gather window for the awaited sessions (see DESIGN.md section 9, "The scheduler"); whether
        they all came."""
        loop = asyncio.get_running_loop()
        window = self.gather_window_s()
        deadline = loop.time() + window
        while not self._ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    def _observe_turnaround(self, all_came: bool | None) -> None:
        """The time from the last batch's results to this batch's start, read once: the goodput
        policy's turnaround, and (after a wait) the round trip the gather window follows, where a
        window that ran out counts as GATHER_MARGIN windows, so the window grows while too short."""
        if self._last_answered is None:
            return
        gap = time.perf_counter() - self._last_answered
        if self.policy is not None:
            self.policy.observe_turnaround(gap)
        if all_came is not None:
            sample = gap if all_came else GATHER_MARGIN * self.gather_window_s()
            self._round_trip_s = 0.5 * self._round_trip_s + 0.5 * min(sample, MAX_GATHER_S)

    def _take(self) -> list[PendingStep]:
        """Waiting steps in arrival order: each session once, at most max_batch_rows rows at the
        least (PendingStep.least; the first step always, however many rows it has). The rest wait
        for the next batch (a stream's next step of a session runs from the position its previous
        step reaches). With cohorts, only the steps of one cohort (`_cohort_to_run`)."""
        cohort = self._cohort_to_run() if self.cohorts > 1 else -1
        batch, rest, seen, rows, full = [], [], set(), 0, False
        for pending in self._queue:
            if batch and rows + pending.least > self.max_batch_rows:
                full = True  # later steps wait too, so arrival order is kept
            if full or pending.session.id in seen or pending.session.cohort != cohort:
                rest.append(pending)
                continue
            seen.add(pending.session.id)
            rows += pending.least
            pending.taken = True
            batch.append(pending)
        self._queue = rest
        self._queued_rows = sum(p.least for p in rest)
        self._cut_short = full
        return batch

    def _cohort_to_run(self) -> int:
        """With cohorts: the sessions queued without one join the smallest cohort (ties: the one
        whose turn comes first), in arrival order; then the batch runs the cohort whose turn it is,
        or the next in turn that has a step queued (a cohort with nothing waiting never holds the
        engine). The turn passes to the cohort after it."""
        n = self.cohorts
        for pending in self._queue:
            session = pending.session
            if session.cohort < 0:
                session.cohort = min(((self._turn + i) % n for i in range(n)), key=lambda c: len(self._members[c]))
                self._members[session.cohort][session.id] = session
        queued = {pending.session.cohort for pending in self._queue}
        cohort = next((self._turn + i) % n for i in range(n) if (self._turn + i) % n in queued)
        self._turn = (cohort + 1) % n
        return cohort

    def _fitting(self, verified: list[int]) -> int:
        """How many of a batch's steps, in order, run: those whose verified rows (k + 1 each) fit
        max_batch_rows, the first always. Only trimming leaves more: `_take` counted a trimmable
        step's least rows, not the rows the policy then keeps."""
        rows = 0
        for n, k in enumerate(verified):
            rows += k + 1
            if n and rows > self.max_batch_rows:
                return n
        return len(verified)

    def _put_back(self, steps: list[PendingStep]) -> None:
        """Steps a batch took but does not run: back to the head of the queue (they came before
        everything queued since; a session's later steps stay behind its own), unanswered, to be
        taken (and checked) again by the next batch, which then waits for nothing."""
        for pending in steps:
            pending.taken = False
        self._queue[:0] = steps
        self._queued_rows += sum(p.least for p in steps)
        self._cut_short = True

    def _check(self, pending: PendingStep) -> rpc.StepResult | None:
        """The step against its session: the error result, or None when it may run. Never changes state."""
        session, step = pending.session, pending.step
        if not self.sessions.is_live(session):
            return error_result(step, grpc.StatusCode.NOT_FOUND, self.sessions.why_missing(session.id, session.principal), 0)
        position = session.sequence.position
        if step.expected_position != position:
            return error_result(step, grpc.StatusCode.ABORTED, f"expected_position {step.expected_position} is stale: "
                                f"the session is at position {position} (Status.current_position)", position)
        if self.policy is not None:
            # the engine's state check on the drafts as sent, before the policy trims them (the
            # engine checks again, inside the step, what it runs): see DESIGN.md section 9, "The scheduler"
            try:
                self.engine.check(StepRequest(session.sequence, pending.drafts, pending.draft_probs, want_logits=False))
            except StepError as err:
                return error_result(step, STEP_ERROR_CODES[err.code], str(err), position)
        return None

    def _trim(self, live: list[PendingStep], requested: list[int]) -> list[int]:
        """Drafts each step of the batch verifies: the policy's choice, except for sessions that
        asked to have every draft verified (verify_all_drafts), which keep all theirs. The policy
        chooses among the others only, its cost model pricing the exempt sessions' rows too."""
        exempt = [i for i, p in enumerate(live) if p.session.verify_all_drafts]
        if not exempt:
            return self.policy.trim([p.session.id for p in live], requested)
        verified = list(requested)
        exempted = set(exempt)
        trimmable = [i for i in range(len(live)) if i not in exempted]
        if trimmable:
            chosen = self.policy.trim([live[i].session.id for i in trimmable], [requested[i] for i in trimmable],
                                      sum(requested[i] + 1 for i in exempt))
            for i, k in zip(trimmable, chosen):
                verified[i] = k
        return verified

    def keep_books(self) -> None:
        """The last batch's metrics and goodput observations (at the latest before the next batch
        is trimmed, which must see them)."""
        if self._bookkeeping is None:
            return
        verified, trimmed, accepted, latencies, judged = self._bookkeeping
        self._bookkeeping = None
        self.metrics.record_steps(verified, trimmed, accepted, latencies)
        if self.policy is not None and judged:
            ids, sent = zip(*judged)
            self.policy.observe_batch(ids, sent, verified, accepted)

    async def _draft(self, batch: list[PendingStep]) -> dict[PendingStep, rpc.StepResult]:
        """Fill the drafts of the batch's server-drafted steps (DESIGN.md section 9, "The scheduler"): for steps
        that may run, the proposal made ahead at their position (`_propose_ahead`), else proposed
        now on the worker; an empty list for the others (their checks answer them). A proposer that
        fails fails its own step INTERNAL, never the batch's others: -> {step: its error result},
        for _run to deliver."""
        drafting, proposed, failed = [], {}, {}
        for pending in batch:
            if pending.drafts is not None:
                continue
            session = pending.session
            seq = session.sequence
            if (self.sessions.is_live(session) and pending.step.expected_position == seq.position
                    and not seq.finished and not seq.lost):
                ahead, session.drafter.ahead = session.drafter.ahead, None  # it serves the step at its position once
                if ahead is not None and ahead.position == seq.position:
                    proposed[pending] = ahead
                else:
                    drafting.append(pending)
            else:
                pending.fill([])
        if not drafting and not proposed:
            return failed
        self._running = batch  # `cut` answers them while they are proposed for
        try:
            running = [asyncio.wrap_future(f) for f in {id(a.future): a.future for a in proposed.values()}.values() if not f.done()]
            if running:  # made ahead on the worker, which is still at it (a failure is its steps', read by _outcome)
                await asyncio.gather(*running, return_exceptions=True)
            outcomes = [(p, _outcome(a.future, a.index)) for p, a in proposed.items()]
            if drafting:
                made = await self.worker.run(_propose, self.engine, [p.session for p in drafting])
                outcomes += zip(drafting, made)
        finally:
            self._running = []
        for pending, drafts in outcomes:
            if isinstance(drafts, Exception):
                log.error("server drafter %r failed: %r", pending.session.drafter.name, drafts)
                pending.fill([])
                failed[pending] = error_result(pending.step, grpc.StatusCode.INTERNAL, "the server-side drafter failed; "
                                               "see the server log", pending.session.sequence.position)
            else:
                pending.fill(drafts)
        return failed

    def _propose_ahead(self, sessions: list[Session]) -> None:
        """Queue on the worker, behind the step that just ran, the next drafts of these server-drafted
        sessions (each goes on, at the position its next step runs from): the proposal runs while
        the event loop answers the batch, and the batch that takes a session's next step finds its
        drafts made (`_draft`). Drafts are a function of the context alone (the proposers are
        row-invariant and keep no state a proposal changes), so they are the drafts a proposal at
        that batch would make."""
        future = self.worker.submit(_propose, self.engine, sessions)
        for index, session in enumerate(sessions):
            session.drafter.ahead = Ahead(session.sequence.position, future, index)

    async def _run(self, batch: list[PendingStep]) -> None:
        self.keep_books()
        failed = await self._draft(batch) if any(p.drafts is None for p in batch) else None
        live = []
        for pending in batch:
            if failed is not None:
                if pending.result is not None:  # `cut` answered it while its drafts were proposed: it runs no more
                    self._release(pending)
                    continue
                if pending in failed:
                    self._deliver(pending, failed[pending], self.sessions.clock())
                    continue
            problem = self._check(pending)
            if problem is None:
                live.append(pending)
            else:
                self._deliver(pending, problem, self.sessions.clock())
        if not live:
            return
        policy = self.policy
        requested = [p.rows - 1 for p in live]
        verified = self._trim(live, requested) if policy is not None else requested
        fit = self._fitting(verified)
        if fit < len(live):
            self._put_back(live[fit:])
            live, requested, verified = live[:fit], requested[:fit], verified[:fit]
        requests = [_request(p, k) for p, k in zip(live, verified)]
        # each server-side drafter observes its step (a step put back keeps its drafts: failed may be None)
        drafters = [p.session.drafter for p in live]
        if not any(drafters):
            drafters = None
        # the waiting prompts' next pieces, taken into this step (DESIGN.md section 9, "Prompts inside a step")
        turn = self.prompts.take() if self.prompts is not None and self.prompts.waiting else []
        started = time.perf_counter()
        self._running = live
        try:
            results, logits, on_thread = await self.worker.run(_step, self.engine, requests, drafters, [w.opening for w in turn],
                                                               self.prompts.step_rows if turn else None)
        except asyncio.CancelledError as exc:  # the job still runs on the worker: its opens fail behind it
            if turn:
                self.prompts.cancel(turn, exc)
            raise
        except BaseException as exc:  # the step failed: so did its opens (the engine released their slots)
            if turn:
                self.prompts.settle(turn, exc)
            raise
        finally:
            self._running = []
        if turn:
            self.prompts.settle(turn)
        self._last_step_s = time.perf_counter() - started
        max_seq_len = self.engine.max_seq_len
        now, clock_now = time.perf_counter(), self.sessions.clock()
        store = self.sessions.store_result
        going_on, ahead = [], []  # ahead: going-on sessions the server drafts for
        ok_verified, ok_accepted, latencies, judged = [], [], [], []  # per OK step; judged: its session and drafts sent
        trimmed = 0
        for pending, asked, k, result, rows in zip(live, requested, verified, results, logits):
            if result.error is not None:  # the engine refuses steps its state cannot take
                self._deliver(pending, error_result(pending.step, STEP_ERROR_CODES[result.error.code], str(result.error),
                                                    result.position), clock_now)
                continue
            session = pending.session
            seq = session.sequence
            if seq.finish_reason is None and seq.position >= max_seq_len:
                # no room for even a one-row step: the context is full, which ends the session
                seq.finish_reason = result.finish_reason = LENGTH
            rid = pending.request_id
            answer = ok_result(session.id, rid, result, k, asked, rows)
            if rid:
                store(session, rid, pending.fingerprint, answer)
            ok_verified.append(k)
            ok_accepted.append(result.accepted)
            latencies.append(now - pending.arrived)
            if policy is not None:
                judged.append((session.id, asked))
                trimmed += asked - k
            self._deliver(pending, answer, clock_now)
            if seq.finish_reason is None:
                going_on.append(session)
                if session.drafter is not None and session.drafter.proposer is not None:
                    ahead.append(session)
        if ahead:
            self._propose_ahead(ahead)
        if ok_verified:
            self.metrics.record_batch(sum(ok_verified) + len(ok_verified), self._last_step_s)  # rows run: k + 1 per OK step
            if self.timings is not None:  # indexed as engine_steps is: recorded where it moves
                self.timings.batch(live, *on_thread)
        self.metrics.record_graph_captures(self.engine.graph_captures)
        # the batch's bookkeeping runs once the answers are on their way: the Verify calls woken
        # above are ahead of it on the event loop, so it overlaps the drafters' turnaround
        self._bookkeeping = (ok_verified, trimmed, ok_accepted, latencies, judged)
        asyncio.get_running_loop().call_soon(self.keep_books)
        self._last_answered = time.perf_counter()
        if self._cut_short:
            # steps that did not fit this batch are queued: their callers (a Verify call answers
            # all its steps at once) cannot send anything before they run, so nothing is awaited
            # (with cohorts, the turn stays with the cohort they belong to)
            self._awaited = set()
            if self.cohorts > 1:
                self._turn = live[0].session.cohort
        elif self.cohorts > 1:
            # the next batch is the next cohort's: it waits for those of its sessions (still open,
            # unfinished) whose next step is not queued, which had this batch's time to come back
            is_live, queued = self.sessions.is_live, {p.session.id for p in self._queue}
            self._awaited = {sid for sid, session in self._members[self._turn].items()
                             if is_live(session) and session.sequence.finish_reason is None and sid not in queued}
        else:
            # the next batch waits for these (still open, unfinished), minus those whose next step is queued already
            is_live = self.sessions.is_live
            self._awaited = {session.id for session in going_on if is_live(session)}.difference(
                p.session.id for p in self._queue)

    def _deliver(self, pending: PendingStep, result: rpc.StepResult, now: float) -> None:
        """Answer a step that a batch took; `now`: the session table's clock."""
        failed = result.HasField("status")  # only error results set it (an unset Status reads as OK)
        if failed:
            self.metrics.record_error(code_name(result.status.code))
        self._release(pending, None if failed else now)
        if pending.result is None:
            pending.finish(result)


def _request(pending: PendingStep, verified: int) -> StepRequest:
    """The engine request of a step that verifies its first `verified` drafts (and, for a session
    drafting with the MTP head, returns its consumed rows' hidden rows for the head)."""
    drafts, probs = pending.drafts, pending.draft_probs
    if verified < len(drafts):
        drafts, probs = drafts[:verified], (probs[:verified] if probs is not None and verified else None)
    drafter = pending.session.drafter
    return StepRequest(pending.session.sequence, drafts, probs, want_logits=pending.step.return_logits,
                       want_hidden=drafter is not None and drafter.wants_hidden)


@dataclass(frozen=True)
class Ahead:
    """A server-drafted session's next drafts, proposed on the worker before its next step came:
    index `index` of `future`'s list, made at `position`."""

    position: int
    future: concurrent.futures.Future
    index: int


def _outcome(future: concurrent.futures.Future, index: int) -> list[int] | Exception:
    """One session's drafts (or its failure) from a done proposal made ahead."""
    try:
        return future.result()[index]
    except Exception as exc:  # noqa: BLE001 - a bug outside any one proposal: that step fails, the batch runs
        return exc


def _propose(engine: Engine, sessions: list[Session]) -> list:
    """On the worker: each session's next drafts from its server-side drafter, or the exception
    its drafter raised (which fails that step alone). The MTP sessions propose together
    (drafting.propose_all: one batched head forward per draft position)."""
    return propose_all([session.drafter for session in sessions], [session.sequence for session in sessions], engine)


def _step(engine: Engine, requests: list[StepRequest], drafters: list | None, openings: list | None = None,
          piece: int | None = None):
    """On the worker: one engine step, the asked-for logits as wire bytes (the device-to-host copy
    stays off the event loop), and the step's start and end on this thread (perf_counter; the end
    once the ids are on the host): two clock reads a batch, so they are taken whether or not round
    timings are kept. `drafters`: per request its session's server-side drafter or None (None for
    all: no session drafts on the server), which observes its OK step's outcome here, in order
    with its proposals. openings, piece: opens whose prompts go on in the step (Engine.step's)."""
    started = time.perf_counter()
    # without openings, step(requests): a tensor-parallel rank's engine (whose opens run whole) takes no others
    results = engine.step(requests, openings, piece) if openings else engine.step(requests)
    on_thread = (started, time.perf_counter())
    if drafters is not None:
        for drafter, result in zip(drafters, results):
            if drafter is not None and result.error is None:
                drafter.observe(result)
    if not any(q.want_logits for q in requests):
        return results, [None] * len(results), on_thread
    logits = [logits_message(r.logits) if q.want_logits and r.error is None else None for q, r in zip(requests, results)]
    return results, logits, on_thread
