"""The Verifier servicer: request checks, sessions, and the hand-off of steps to the scheduler.
The design in full: DESIGN.md section 8, "The servicer".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time

import grpc

from .. import rpc
from ..engine import Engine, Opened, Opening
from ..proposers.mtp import MTPDrafter
from .config import ServerConfig
from .convert import FINISH_REASONS, error_result, logits_message
from .drafting import MTP, NGRAM, ServerDrafter
from .goodput import GoodputPolicy, StepCost
from .malformed import Malformed, refuse
from .metrics import Metrics
from .retries import open_fingerprint, reused_open_id, reused_step_id, step_fingerprint
from .answer import Answer
from .calls import CallBook
from .scheduler import PendingStep, Scheduler
from .prefill import PromptTurns
from .principals import ANONYMOUS, Principals
from .sessions import OVER_QUOTA, Session, SessionTable
from .timings import RoundTimings
from .validate import Invalid, checked_prompt, open_drafter, open_limits, prompt_source, repeated_sessions, request_steps, step_drafts
from .worker import Worker

log = logging.getLogger(__name__)

_VERIFY_STREAM = f"/{rpc.SERVICE_NAME}/VerifyStream"
_VERIFY_ROUNDS = f"/{rpc.SERVICE_NAME}/VerifyRounds"
# a StepResult's fields beside its logits and its two ids (status, positions, counts, at most K + 1
# tokens, a status message), generously; the ids are counted as sent
ANSWER_FIELD_BYTES = 1024
_STOPPING_TRAILER = ((rpc.STOPPING_KEY, "1"),)  # on the UNAVAILABLE the server ends a call with as it drains or stops
# Generate: results of a session's chained steps that may wait for gRPC to take them (a caller that
# reads slowly holds its session's steps back, not the server's memory)
GENERATE_AHEAD = 4
_STOPPING = "the server is stopping: this stream takes no more requests (its earlier ones are answered); resend on a new call"


class RequestAnswer(Answer):
    """A VerifyRequest's steps from submission to its VerifyResponse (`result` once every step is
    answered). The steps count down to it (not a future per step, gathered)."""

    __slots__ = ("tickets", "left")

    def __init__(self, tickets: list[PendingStep]):
        super().__init__()
        self.tickets = tickets
        waiting = [t for t in tickets if t.result is None]
        self.left = len(waiting)
        if not waiting:
            self._answer()
        for ticket in waiting:
            ticket.on_done(self._one_answered)

    def _one_answered(self) -> None:
        self.left -= 1
        if self.left == 0:
            self._answer()

    def _answer(self) -> None:
        self.finish(rpc.VerifyResponse(results=[t.result for t in self.tickets]))

    def withdraw(self, scheduler: Scheduler) -> None:
        """Its caller went away: its steps still queued leave the queue (scheduler.withdraw)."""
        for ticket in self.tickets:
            if ticket.result is None:
                scheduler.withdraw(ticket)


class VerifierService:
    def __init__(self, config: ServerConfig, engine: Engine, tokenizer, metrics: Metrics, mtp: MTPDrafter | None = None,
                 calls: CallBook | None = None, principals: Principals | None = None):
        """mtp: the checkpoint's MTP head with its KV pool of a slot per engine slot
        (proposers/mtp.py), made by the server; None: no "mtp" drafter. calls: the server's book of
        calls in flight (verifier/server/calls.py), which the handlers that wait enter and leave.
        principals: who each call comes from (verifier/server/principals.py); None: no auth, one
        anonymous principal."""
        self.config = config
        self.principals = principals if principals is not None else Principals({})
        self.calls = calls if calls is not None else CallBook()
        # requests a stream may have outstanding (accepted, not yet taken by its client): every slot's
        # step queued and one more being answered
        self.stream_window = 2 * engine.n_slots
        self.engine = engine
        self.mtp = mtp
        # ModelInfo.server_drafters: the n-gram proposer needs no model, the MTP one the head
        self.server_drafters = (NGRAM, MTP) if mtp is not None else (NGRAM,)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.vocab = engine.vocab_size
        self.sessions = SessionTable(engine.n_slots, config.results_per_session,
                                     max_per_principal=config.max_sessions_per_principal)
        self.worker = Worker()
        # OpenSession texts are encoded here, one at a time, never on the event loop nor the engine's worker
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verifier-tokenize")
        # the opens' prompts in turns on the worker, a turn the next chunks of those waiting up to
        # config.prefill_rows rows: between two batches of the running sessions at most one turn runs
        # (with config.step_prompt_rows, the batches take the waiting prompts into their steps)
        self.prompts = PromptTurns(self.worker, engine, config.prefill_rows, config.step_prompt_rows, metrics)
        self.scheduler: Scheduler | None = None
        self.draining = False
        self.stopping = False  # begin_stop: streams end once answered; steps of a cut server get UNAVAILABLE
        self._cut_message: str | None = None  # set by cut
        self._stream_wakers: set = set()  # each open stream's answering loop, woken by begin_stop
        self._admission_waits: set[asyncio.Future] = set()  # OpenSession calls waiting for their admission, ended by cut
        self._reaper: asyncio.Task | None = None
        # --round-timings: where each round's time goes (verifier/server/timings.py); None: not kept
        self.timings = RoundTimings(config.round_timings) if config.round_timings is not None else None
        metrics.watch_sessions(self.sessions)
        if engine.prefix_cache is not None:
            metrics.watch_prefix_cache(engine.prefix_cache.stats)

    async def start(self) -> None:
        """Warm the engine up (graph buckets, step costs) before anything is served, then schedule."""
        started = time.perf_counter()
        captures, costs = await self.worker.run(_warm_up, self.engine, self.config.goodput)
        self.metrics.record_graph_captures(captures)
        log.info("engine warm-up: %d graph buckets captured, step costs %s, in %.2f s", captures,
                 f"measured for {len(costs)} row counts" if costs else "not measured (--no-goodput)",
                 time.perf_counter() - started)
        policy = GoodputPolicy(self.engine.max_k, StepCost(costs)) if costs else None
        self.scheduler = Scheduler(self.engine, self.worker, self.sessions, self.metrics,
                                   self.config.max_batch_rows, self.config.max_wait_ms, policy, self.timings, self.config.cohorts,
                                   self.prompts)
        self.scheduler.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap(self.config.idle_timeout_s), name="verifier-reaper")

    def begin_stop(self) -> None:
        """The port is closing: queued steps run now (no gather window), streams end once their
        accepted requests are answered (UNAVAILABLE: a stream reads nothing more)."""
        self.draining = self.stopping = True
        if self.scheduler is not None:
            self.scheduler.begin_stop()
        for wake in list(self._stream_wakers):
            wake()

    def cut(self, message: str) -> None:
        """The grace period ran out: answer UNAVAILABLE to everything still waiting (see the module
        docstring); what the engine runs still completes, unanswered."""
        self.begin_stop()
        self._cut_message = message
        if self.scheduler is not None:
            self.scheduler.cut(message)
        for waiter in list(self._admission_waits):
            if not waiter.done():
                waiter.set_result(None)

    async def stop(self) -> None:
        """After the gRPC server has stopped: run what is queued, free every slot, stop the worker."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self.scheduler is not None:
            await self.scheduler.stop()
        for session in self.sessions.all():
            self._end(session.id, "closed: the server stopped")
        await asyncio.get_running_loop().run_in_executor(None, self.worker.shutdown)
        self._tokenizing.shutdown(wait=False)
        if self.timings is not None:
            self.timings.write()

    # ---- RPCs -------------------------------------------------------------------------------

    async def GetModelInfo(self, request: rpc.GetModelInfoRequest, context) -> rpc.ModelInfo:
        config = self.engine.model.config
        return rpc.ModelInfo(
            protocol_version=rpc.PROTOCOL_VERSION, model_id=self.config.model_dir.name, model_type=config.model_type,
            vocab_size=config.vocab_size, eos_ids=list(config.eos_token_ids), max_context=self.engine.max_seq_len,
            max_k=self.engine.max_k, layer_kinds=list(config.mixers), rollback_mode=self.engine.rollback_mode,
            has_tokenizer=self.tokenizer is not None, n_slots=self.engine.n_slots,
            device=str(self.engine.model.device), dtype=self.config.dtype, trims_drafts=self.config.goodput,
            server_drafters=list(self.server_drafters),
        )

    async def OpenSession(self, request: rpc.OpenSessionRequest, context) -> rpc.OpenSessionResponse:
        self.calls.enter()
        try:
            return await self._open_session(request, context)
        finally:
            self.calls.leave()

    async def _open_session(self, request: rpc.OpenSessionRequest, context) -> rpc.OpenSessionResponse:
        if self.draining:
            await self._abort_open(context, grpc.StatusCode.UNAVAILABLE, "the server is draining: open the session on another replica",
                                   _STOPPING_TRAILER)
        principal = self.principals.of(context)
        rid = request.request_id
        key = (principal, rid)  # request ids are the principal's own
        fingerprint = open_fingerprint(request) if rid else None
        if rid and key in self.sessions.opens:  # a retry: the same session, admitted once (even if closed since)
            return await self._retried_open(key, fingerprint, context)
        max_seq_len = self.engine.max_seq_len
        try:
            prompt, text = prompt_source(request, self.tokenizer, max_seq_len)
            sampling, max_new_tokens = open_limits(request)
            drafter = open_drafter(request, self.server_drafters, self.engine.max_k)
            if text is not None:  # off the event loop: other calls go on while a long text is encoded
                prompt = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self.tokenizer.encode, text)
            prompt = checked_prompt(prompt, "prompt_ids" if text is None else "text", self.vocab, max_seq_len)
        except Invalid as exc:
            await self._abort_open(context, exc.code, exc.message)
        if rid and key in self.sessions.opens:  # the same request arrived while this one was tokenized
            return await self._retried_open(key, fingerprint, context)
        # from here to the registration of the admission in opens nothing awaits: one admission per request id
        refused = self.sessions.reserve(principal)
        if refused is not None:
            ms = self._retry_after_ms()
            why = (f"{principal!r} holds {self.sessions.max_per_principal} sessions, its most (--max-sessions-per-principal): "
                   f"close one first" if refused == OVER_QUOTA else f"all {self.sessions.n_slots} slots are in use")
            await self._abort_open(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry after {ms} ms ({rpc.RETRY_AFTER_KEY})",
                                   ((rpc.RETRY_AFTER_KEY, str(ms)),))
        task = asyncio.ensure_future(self._admit(prompt, sampling, max_new_tokens, request, drafter, principal))
        if rid:
            self.sessions.opens[key] = (fingerprint, task)  # a retry after a cancel or deadline finds the session
        try:
            return await self._admitted(task, context)
        except asyncio.CancelledError:
            if not rid:  # no one can ever name the session: close it once it is admitted
                task.add_done_callback(self._close_orphan)
            raise

    async def _retried_open(self, key: tuple[str, str], fingerprint, context) -> rpc.OpenSessionResponse:
        """A repeat of an open's request id: the first one's response, or INVALID_ARGUMENT for other content."""
        earlier, task = self.sessions.opens[key]
        if earlier != fingerprint:
            error = reused_open_id(key[1])
            await self._abort_open(context, error.code, error.message)
        return await self._admitted(task, context)

    async def _admitted(self, task: asyncio.Future, context) -> rpc.OpenSessionResponse:
        """The admission's response; the admission runs on if this caller leaves. UNAVAILABLE when
        the server's grace period runs out first (cut)."""
        if not task.done():
            waiter = asyncio.get_running_loop().create_future()
            task.add_done_callback(lambda _: waiter.done() or waiter.set_result(None))
            self._admission_waits.add(waiter)
            try:
                await waiter
            finally:
                self._admission_waits.discard(waiter)
            if not task.done():
                await self._abort_open(context, grpc.StatusCode.UNAVAILABLE, self._cut_message, _STOPPING_TRAILER)
        return task.result()

    async def Verify(self, request: rpc.VerifyRequest, context) -> rpc.VerifyResponse:
        try:
            answer = self._submit_request(request, self.principals.of(context))
        except Invalid as exc:  # the request as a whole (its size)
            await context.abort(exc.code, exc.message)
        # one wait for the whole request (its steps usually finish in one batch), not one per step
        result = await self._answer_of(answer)
        if self.timings is not None:  # handed to gRPC (a unary answer's write is not seen from here)
            self.timings.written(answer)
        return result

    # The two streams are async generator functions of their own (grpc.aio runs any other handler
    # as a sync one), each one hop over the shared _answer_in_order.
    async def VerifyStream(self, request_iterator, context):
        principal = self.principals.of(context)
        submit = lambda step: self._submit(step, step.session_id, time.perf_counter(), principal)  # noqa: E731
        async for result in self._answer_in_order(request_iterator, context, _VERIFY_STREAM, submit):
            yield result

    async def VerifyRounds(self, request_iterator, context):
        principal = self.principals.of(context)
        submit = lambda request: self._submit_request(request, principal)  # noqa: E731
        async for response in self._answer_in_order(request_iterator, context, _VERIFY_ROUNDS, submit):
            yield response

    async def _answer_in_order(self, request_iterator, context, method: str, submit):
        """A stream's answers: each request is submitted as it arrives (so one stream's requests
        share batches with everyone's) and answered in order. `submit(request)` -> a PendingStep
        (VerifyStream) or a RequestAnswer (VerifyRounds): `.result` once answered, `.on_done`.
        `outstanding` holds those not yet answered to the client, oldest first; the answering loop
        waits on one future at a time, woken when the oldest is answered or when reading ends (not
        a queue hop plus a future per request: each hop is a turn of the event loop). At most
        `window` requests are outstanding: past that the reader reads no more until the client has
        taken an answer, so a client that sends and never reads holds a bounded server (HTTP/2 flow
        control then stops its writes), never a growing pile of unread answers."""
        outstanding: collections.deque = collections.deque()
        loop = asyncio.get_running_loop()
        woken: asyncio.Future | None = None  # what the answering loop awaits, None while it runs
        room: asyncio.Future | None = None  # what the reader awaits while the window is full
        window = self.stream_window
        reading = True
        refused_more = False  # the reader stopped at a request because the server is stopping

        def wake() -> None:
            if woken is not None and not woken.done():
                woken.set_result(None)

        def make_room() -> None:
            if room is not None and not room.done():
                room.set_result(None)

        async def read():
            nonlocal reading, refused_more, room
            try:
                async for request in request_iterator:
                    if self.stopping:  # not accepted: the stream ends UNAVAILABLE, the client resends elsewhere
                        refused_more = True
                        break
                    if isinstance(request, Malformed):  # the guard leaves stream requests unwrapped
                        await refuse(context, method, request)
                    try:
                        ticket = submit(request)
                    except Invalid as exc:  # a request as a whole (its size): the stream ends with it
                        await context.abort(exc.code, exc.message)
                    outstanding.append(ticket)
                    if len(outstanding) == 1 and woken is not None:  # the answering loop waits for it
                        ticket.on_done(wake)
                    while len(outstanding) >= window and not self.stopping:  # full: wait for the client to read
                        room = loop.create_future()
                        await room
                        room = None
            finally:
                reading = False
                wake()

        reader = loop.create_task(read())
        self._stream_wakers.add(wake)
        timings = self.timings
        self.calls.enter()
        try:
            while True:
                while outstanding and outstanding[0].result is not None:
                    answered = outstanding.popleft()
                    make_room()
                    if timings is not None:  # handed to gRPC: before the yield, surely before the client has it
                        timings.written(answered)
                    yield answered.result  # resumes once gRPC has taken the message
                if not outstanding and (not reading or self.stopping):
                    break
                woken = loop.create_future()
                if outstanding:
                    outstanding[0].on_done(wake)
                await woken
                woken = None
            if self.stopping and (reading or refused_more):
                # requests it did not read (or read and did not accept) were never taken: UNAVAILABLE
                # tells the client to resend them elsewhere (an ended stream, OK, would say it is done)
                reader.cancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, _STOPPING, trailing_metadata=_STOPPING_TRAILER)
            await reader  # a broken request stream raises here
        finally:
            self.calls.leave()
            self._stream_wakers.discard(wake)
            reader.cancel()
            for ticket in outstanding:
                ticket.withdraw(self.scheduler)

    async def Generate(self, request: rpc.GenerateRequest, context):
        """A self-drafting session run to its end on the server (the proto says the contract): the
        open as OpenSession's, then its steps chained: each is submitted where the scheduler answers
        the one before (GENERATE_AHEAD results at most waiting for gRPC), so the session's next
        step is queued before that batch ends and waits neither for gRPC's write nor for this
        handler; its results streamed in order as they come."""
        opening = request.open
        if not opening.server_drafter:
            await self._abort_open(context, grpc.StatusCode.INVALID_ARGUMENT,
                                   "open.server_drafter: Generate runs a session the server drafts for: name one of "
                                   f"ModelInfo.server_drafters ({', '.join(self.server_drafters)})")
        principal = self.principals.of(context)
        self.calls.enter()
        try:
            opened = await self._open_session(opening, context)
        finally:
            self.calls.leave()
        yield rpc.GenerateEvent(opened=opened)
        session_id = opened.session_id
        loop = asyncio.get_running_loop()
        tickets: collections.deque[PendingStep] = collections.deque()  # submitted, in order; popped once streamed
        woken: asyncio.Future | None = None  # what this handler awaits, None while it runs

        def wake() -> None:
            if woken is not None and not woken.done():
                woken.set_result(None)

        def submit(position: int) -> None:
            step = rpc.VerifyStep(session_id=session_id, expected_position=position, return_logits=opening.return_logits)
            ticket = self._submit(step, session_id, time.perf_counter(), principal)
            tickets.append(ticket)
            ticket.on_done(lambda: chain(ticket))

        def chain(ticket: PendingStep) -> None:
            # runs where the scheduler answers the step (inside its batch): the next step queues at once
            result = ticket.result
            if (tickets and tickets[-1] is ticket and len(tickets) < GENERATE_AHEAD and not self.stopping
                    and not result.status.code and result.finish_reason == rpc.FINISH_NONE):
                submit(result.position)
            wake()

        self.calls.enter()
        try:
            if opened.finish_reason == rpc.FINISH_NONE:
                submit(opened.position)
            while tickets:
                while tickets and tickets[0].result is not None:
                    result = tickets.popleft().result
                    yield rpc.GenerateEvent(step=result)
                    if result.status.code or result.finish_reason != rpc.FINISH_NONE:
                        return
                    if not tickets:  # not chained: the window was full, or the server is stopping
                        if self.stopping:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping: the tokens streamed so far "
                                                "are final; open the prompt and them on another replica",
                                                trailing_metadata=_STOPPING_TRAILER)
                        submit(result.position)
                if tickets:  # its head unanswered: `chain` wakes this handler when it is
                    woken = loop.create_future()
                    await woken
                    woken = None
        finally:
            self.calls.leave()
            for ticket in tickets:
                ticket.withdraw(self.scheduler)
            self._end(session_id, "closed: its Generate call ended")

    async def _answer_of(self, answer: "PendingStep | RequestAnswer"):
        """A submitted step's or request's result, waited for as a call in flight (calls); if the
        caller leaves first, what is still queued is withdrawn."""
        if answer.result is None:
            answered = asyncio.get_running_loop().create_future()
            answer.on_done(lambda: answered.done() or answered.set_result(None))
            self.calls.enter()
            try:
                await answered
            except asyncio.CancelledError:
                answer.withdraw(self.scheduler)
                raise
            finally:
                self.calls.leave()
        return answer.result

    async def CloseSession(self, request: rpc.CloseSessionRequest, context) -> rpc.CloseSessionResponse:
        # A step the engine runs now completes and is answered; the slot's release queues behind it.
        # A step still queued finds its session gone when its batch is taken: NOT_FOUND.
        session = self.sessions.find(request.session_id, self.principals.of(context))
        if session is not None:  # another principal's session is not there for this caller
            self._end(session.id, "closed")
        return rpc.CloseSessionResponse(closed=session is not None)

    async def GetStats(self, request: rpc.GetStatsRequest, context) -> rpc.Stats:
        if self.scheduler is not None:
            self.scheduler.keep_books()  # the last batch's figures, if its bookkeeping has not run yet
        return self.metrics.stats()

    # ---- helpers ----------------------------------------------------------------------------

    async def _abort_open(self, context, code: grpc.StatusCode, message: str, trailing=()):
        self.metrics.record_open_error(code.name)
        await context.abort(code, message, trailing_metadata=trailing)

    async def _admit(self, prompt: list[int], sampling, max_new_tokens: int, request: rpc.OpenSessionRequest,
                     drafter: tuple[str, int] | None, principal: str) -> rpc.OpenSessionResponse:
        """Prefill on the worker and register the session; runs to the end even if the caller leaves.
        `drafter`: (server_drafter, drafts per step), None when the client drafts; `principal`: its owner."""
        try:
            # a job per turn of prompt chunks (PromptTurns): the batches of the running sessions
            # take their turns on the worker between them, so prompts arriving stall them a turn at
            # a time, however many arrive together, and those that arrive together share forwards
            want_hidden = drafter is not None and drafter[0] == MTP  # the MTP head starts from the prompt's hidden rows
            opening = await self.worker.run(self.engine.opening, prompt, sampling, max_new_tokens, None, want_hidden)
            await self.prompts.ingest(opening)
            seq, logits, proposer = await self.worker.run(_open, self.engine, opening, request.return_logits, drafter, self.mtp)
        except BaseException:
            self.sessions.unreserve(principal)
            if request.request_id:
                self.sessions.opens.pop((principal, request.request_id), None)
            raise
        session = self.sessions.add(seq, principal, request.request_id, request.verify_all_drafts, proposer)
        response = rpc.OpenSessionResponse(session_id=session.id, position=seq.position, first_token=seq.pending,
                                           finish_reason=FINISH_REASONS[seq.finish_reason], prompt_ids=prompt)
        if logits is not None:
            response.logits.CopyFrom(logits)
        return response

    def _end(self, session_id: str, why: str) -> Session | None:
        """Forget a session (closed, reaped, the server stopping) and release its slot on the worker,
        behind any step of it still running."""
        session = self.sessions.remove(session_id, why)
        if session is not None:
            self.worker.submit(self.engine.close, session.sequence)
            if self.scheduler is not None:
                self.scheduler.forget(session_id)
        return session

    def _close_orphan(self, task) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        self._end(task.result().session_id, "closed: its OpenSession call was cancelled")

    def _retry_after_ms(self) -> int:
        """The retry hint of a refused open: the expected wait for a slot (the recent spacing of slot
        releases), at least --retry-after-ms and at most the idle timeout (what an abandoned session
        can hold a slot for); --retry-after-ms itself before any release was seen."""
        expected = self.sessions.expected_wait_s()
        if expected is None:
            return self.config.retry_after_ms
        return int(min(max(expected * 1000, self.config.retry_after_ms), self.config.idle_timeout_s * 1000))

    def _submit_request(self, request: rpc.VerifyRequest, principal: str) -> "RequestAnswer":
        """A VerifyRequest's steps submitted (or answered at once), as one answer to wait for; Invalid
        for a request of more steps than slots (checked before any step is read)."""
        request_steps(len(request.steps), self.sessions.n_slots)
        steps = list(request.steps)  # one wrapper per step, kept: each pass over the wire's list makes new ones
        session_ids = [step.session_id for step in steps]  # read once: each read of a wire string makes a new str
        repeated = repeated_sessions(session_ids)
        arrived = time.perf_counter()
        # sized once for the whole answer (only logits can make it large), not again per step
        too_large = self._answer_over_limit(steps, session_ids, principal) if any(step.return_logits for step in steps) else None
        return RequestAnswer([self._refuse(step, grpc.StatusCode.INVALID_ARGUMENT, repeated[i], principal=principal) if i in repeated
                              else self._refuse(step, grpc.StatusCode.RESOURCE_EXHAUSTED, too_large, principal=principal)
                              if too_large and step.return_logits
                              else self._submit(step, session_id, arrived, principal, sized=True)
                              for i, (step, session_id) in enumerate(zip(steps, session_ids))])

    def _answer_bytes(self, step: rpc.VerifyStep, session_id: str, principal: str) -> int:
        """The most bytes a step's result can take on the wire: its logits (len(tokens) <= the drafts
        verified + 1 rows of the vocabulary in float32, when asked), its ids and ANSWER_FIELD_BYTES for the rest."""
        fields = ANSWER_FIELD_BYTES + len(session_id) + len(step.request_id)
        if not step.return_logits:
            return fields
        session = self.sessions.find(session_id, principal)
        drafts = session.drafter.k if session is not None and session.drafter is not None else len(step.draft_ids)
        rows = min(drafts, self.engine.max_k) + 1
        return fields + rows * self.vocab * 4

    def _answer_over_limit(self, steps: list, session_ids: list[str], principal: str) -> str | None:
        """Why the answer to these steps could exceed the message limit (--max-message-mb), before any
        runs: a step that ran and could not be answered would lose its tokens for good; None if it fits."""
        total = sum(self._answer_bytes(step, session_id, principal) for step, session_id in zip(steps, session_ids))
        limit = self.config.max_message_bytes
        if total <= limit:
            return None
        asking = sum(1 for step in steps if step.return_logits)
        return (f"return_logits: the answer could take {total / (1 << 20):.1f} MiB ({asking} step(s) with up to K + 1 logits rows "
                f"of {self.vocab} float32 each), over the server's message limit of {limit / (1 << 20):g} MiB (--max-message-mb); "
                "nothing ran: ask for logits in fewer steps per call, or raise --max-message-mb")

    def _refuse(self, step: rpc.VerifyStep, code: grpc.StatusCode, message: str, session: Session | None = None,
                principal: str = ANONYMOUS) -> PendingStep:
        """Answer a step without the engine, at its session's position (0 without a live session of
        `principal`'s: another's session's position is not told)."""
        if session is None:
            session = self.sessions.find(step.session_id, principal)
        position = session.sequence.position if session is not None else 0
        self.metrics.record_error(code.name)
        return self.scheduler.answered(step, error_result(step, code, message, position))

    def _submit(self, step: rpc.VerifyStep, session_id: str, arrived: float, principal: str,
                sized: bool = False) -> PendingStep:
        """Check the step's wire fields, find its session, answer a retry from the stored result or
        join it to the same step in flight, else queue it. `session_id`: the step's, read once;
        `arrived` (perf_counter) is read once per request;
        sized: its answer's size was checked with its request's (else, a stream's step, here);
        `principal`: the caller's, who must own the session."""
        if self._cut_message is not None:  # the grace period is over: nothing more runs
            return self._refuse(step, grpc.StatusCode.UNAVAILABLE, self._cut_message, principal=principal)
        if step.return_logits and not sized:  # a stream's step: its answer is one message
            too_large = self._answer_over_limit([step], [session_id], principal)
            if too_large:
                return self._refuse(step, grpc.StatusCode.RESOURCE_EXHAUSTED, too_large, principal=principal)
        try:
            drafts, draft_probs = step_drafts(step, session_id, self.engine.max_k, self.vocab)
        except Invalid as exc:
            return self._refuse(step, exc.code, exc.message, principal=principal)
        session = self.sessions.find(session_id, principal)
        if session is None:
            return self._refuse(step, grpc.StatusCode.NOT_FOUND, self.sessions.why_missing(session_id, principal))
        if session.drafter is not None:
            if drafts:  # draft_probs without draft_ids is refused by step_drafts
                return self._refuse(step, grpc.StatusCode.INVALID_ARGUMENT,
                                    f"draft_ids: the session drafts on the server (server_drafter "
                                    f"{session.drafter.name!r}): its steps carry no draft_ids", session)
            drafts = None  # proposed by the scheduler when the step is taken into a batch
        rid = step.request_id
        fingerprint = step_fingerprint(step, drafts) if rid else None
        if rid:
            stored, in_flight = session.results.get(rid), session.inflight.get(rid)
            earlier = stored.fingerprint if stored is not None else in_flight.fingerprint if in_flight is not None else None
            if earlier is not None and earlier != fingerprint:
                error = reused_step_id(rid)
                return self._refuse(step, error.code, error.message, session)
            if stored is not None:
                return self.scheduler.answered(step, stored.result)
            if in_flight is not None:
                return self.scheduler.join(in_flight)
        return self.scheduler.submit(step, rid, session, drafts, draft_probs, fingerprint, arrived)

    async def _reap(self, timeout_s: float) -> None:
        interval = min(1.0, timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for session in self.sessions.idle(timeout_s):
                self._end(session.id, f"reaped after {timeout_s:g} s idle (idle_timeout_s)")
                log.info("reaped session %s after %g s idle", session.id, timeout_s)


def _warm_up(engine: Engine, measure_costs: bool) -> tuple[int, dict[int, float] | None]:
    """On the worker, before serving: capture every graph bucket, and measure the step cost by rows
    when the goodput policy needs it. -> (captures so far, {rows: seconds} or None)."""
    engine.warm_up()
    return engine.graph_captures, engine.step_costs() if measure_costs else None


def _open(engine: Engine, opening: "Opening | Opened", want_logits: bool, drafter: tuple[str, int] | None,
          mtp: MTPDrafter | None) -> tuple:
    """On the worker, once the prompt is in: the sequence, the first token's logits row as wire
    bytes when asked, and the session's server-side drafter (None when the client drafts), fed the prompt."""
    seq = opening.sequence()
    try:
        proposer = ServerDrafter(drafter[0], drafter[1], opening.prompt, seq, engine, mtp) if drafter is not None else None
    except BaseException:
        engine.close(seq)  # the slot comes back with the reservation (_admit)
        raise
    return seq, logits_message(seq.first_logits[None]) if want_logits else None, proposer
