"""The Verifier servicer: request checks, sessions, and the hand-off of steps to the scheduler.

Status codes (DESIGN.md section 8): a failed OpenSession aborts the call; in Verify and
VerifyStream errors are per step (StepResult.status) and the call itself succeeds, so one bad
step never fails the others.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from .. import rpc
from ..engine import Engine, StepError
from .config import ServerConfig
from .convert import FINISH_REASONS, STEP_ERROR_CODES, error_result, logits_message
from .metrics import Metrics
from .scheduler import PendingStep, Scheduler
from .sessions import SessionTable
from .validate import Invalid, open_limits, open_prompt, step_drafts
from .worker import Worker

log = logging.getLogger(__name__)


class VerifierService:
    def __init__(self, config: ServerConfig, engine: Engine, tokenizer, metrics: Metrics):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.vocab = engine.vocab_size
        self.sessions = SessionTable(engine.pool.n_slots, config.results_per_session)
        self.worker = Worker()
        self.scheduler: Scheduler | None = None
        self.draining = False
        self._reaper: asyncio.Task | None = None
        metrics.watch_sessions(self.sessions)

    async def start(self) -> None:
        self.scheduler = Scheduler(self.engine, self.worker, self.sessions, self.metrics,
                                   self.config.max_batch_rows, self.config.max_wait_ms)
        self.scheduler.start()
        if self.config.idle_timeout_s is not None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(self.config.idle_timeout_s), name="verifier-reaper")

    async def stop(self) -> None:
        """After the gRPC server has stopped: run what is queued, free every slot, stop the worker."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self.scheduler is not None:
            await self.scheduler.stop()
        for session in self.sessions.all():
            self.sessions.remove(session.id, "closed: the server stopped")
            self.worker.submit(self.engine.close, session.sequence)
        await asyncio.get_running_loop().run_in_executor(None, self.worker.shutdown)

    # ---- RPCs -------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        config = self.engine.model.config
        return rpc.ModelInfo(
            protocol_version=rpc.PROTOCOL_VERSION, model_id=self.config.model_dir.name, model_type=config.model_type,
            vocab_size=config.vocab_size, eos_ids=list(config.eos_token_ids), max_context=self.engine.pool.max_seq_len,
            max_k=self.engine.max_k, layer_kinds=list(config.mixers), rollback_mode=self.engine.rollback_mode,
            has_tokenizer=self.tokenizer is not None, n_slots=self.engine.pool.n_slots,
            device=str(self.engine.model.device), dtype=self.config.dtype,
        )

    async def OpenSession(self, request, context):
        if self.draining:
            await self._abort_open(context, grpc.StatusCode.UNAVAILABLE, "the server is draining: open the session on another replica")
        rid = request.request_id
        if rid and rid in self.sessions.opens:  # a retry: the same session, admitted once
            return await self._await_open(self.sessions.opens[rid], context)
        try:
            prompt = open_prompt(request, self.tokenizer, self.vocab, self.engine.pool.max_seq_len)
            sampling, max_new_tokens = open_limits(request)
        except Invalid as exc:
            await self._abort_open(context, exc.code, exc.message)
        if not self.sessions.reserve():
            ms = self.config.retry_after_ms
            await self._abort_open(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"all {self.sessions.n_slots} slots are in use: retry after {ms} ms ({rpc.RETRY_AFTER_KEY})",
                                   ((rpc.RETRY_AFTER_KEY, str(ms)),))
        task = asyncio.ensure_future(self._admit(prompt, sampling, max_new_tokens, request))
        if rid:
            self.sessions.opens[rid] = task  # a retry after a cancel or deadline finds the session
        try:
            return await self._await_open(task, context)
        except asyncio.CancelledError:
            if not rid:  # no one can ever name this session: close it once it is admitted
                task.add_done_callback(self._close_orphan)
            raise

    async def Verify(self, request, context):
        first_at: dict[str, int] = {}
        tickets = []
        for i, step in enumerate(request.steps):
            if step.session_id and step.session_id in first_at:
                tickets.append(self._answer(step, grpc.StatusCode.INVALID_ARGUMENT,
                                            f"steps[{i}].session_id duplicates steps[{first_at[step.session_id]}]: "
                                            f"a session may appear once per Verify request"))
                continue
            first_at[step.session_id] = i
            tickets.append(self._submit(step))
        try:
            results = [await asyncio.shield(t.future) for t in tickets]
        except asyncio.CancelledError:
            for t in tickets:
                self.scheduler.withdraw(t)
            raise
        return rpc.VerifyResponse(results=results)

    async def VerifyStream(self, request_iterator, context):
        # Steps are submitted as they arrive (so one stream's steps of several sessions share a
        # batch) and answered in order.
        tickets: asyncio.Queue = asyncio.Queue()
        outstanding: list[PendingStep] = []

        async def read():
            try:
                async for step in request_iterator:
                    ticket = self._submit(step)
                    outstanding.append(ticket)
                    tickets.put_nowait(ticket)
            finally:
                tickets.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (ticket := await tickets.get()) is not None:
                result = await asyncio.shield(ticket.future)
                outstanding.remove(ticket)
                yield result
            await reader  # a broken request stream raises here
        finally:
            reader.cancel()
            for ticket in outstanding:
                self.scheduler.withdraw(ticket)

    async def CloseSession(self, request, context):
        session = self.sessions.remove(request.session_id, "closed")
        if session is not None:
            self.worker.submit(self.engine.close, session.sequence)  # after any step still running on it
        return rpc.CloseSessionResponse(closed=session is not None)

    async def GetStats(self, request, context):
        return self.metrics.stats()

    # ---- helpers ----------------------------------------------------------------------------

    async def _abort_open(self, context, code: grpc.StatusCode, message: str, trailing=()):
        self.metrics.record_open_error(code.name)
        await context.abort(code, message, trailing_metadata=trailing)

    async def _admit(self, prompt, sampling, max_new_tokens, request):
        """Prefill on the worker and register the session; runs to the end even if the caller leaves."""
        try:
            seq, logits = await self.worker.run(_open, self.engine, prompt, sampling, max_new_tokens, request.return_logits)
        except BaseException as exc:
            self.sessions.unreserve()
            if request.request_id:
                self.sessions.opens.pop(request.request_id, None)
            if isinstance(exc, StepError):
                raise Invalid(STEP_ERROR_CODES[exc.code], str(exc)) from None
            raise
        session = self.sessions.add(seq, request.request_id)
        response = rpc.OpenSessionResponse(session_id=session.id, position=seq.position, first_token=seq.pending,
                                           finish_reason=FINISH_REASONS[seq.finish_reason], prompt_ids=prompt)
        if logits is not None:
            response.logits.CopyFrom(logits)
        return response

    async def _await_open(self, task, context):
        try:
            return await asyncio.shield(task)
        except Invalid as exc:
            await self._abort_open(context, exc.code, exc.message)

    def _close_orphan(self, task) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        session = self.sessions.remove(task.result().session_id, "closed: its OpenSession call was cancelled")
        if session is not None:
            self.worker.submit(self.engine.close, session.sequence)

    def _answer(self, step, code: grpc.StatusCode, message: str) -> PendingStep:
        self.metrics.record_error(code.name)
        return self.scheduler.answered(step, error_result(step, code, message))

    def _submit(self, step) -> PendingStep:
        """Check the step's own fields, find its session, answer a retry from the stored result or
        join it to the same step in flight, else queue it."""
        try:
            drafts, draft_probs = step_drafts(step, self.engine.max_k, self.vocab)
        except Invalid as exc:
            return self._answer(step, exc.code, exc.message)
        try:
            session = self.sessions.get(step.session_id)
        except LookupError as exc:
            return self._answer(step, grpc.StatusCode.NOT_FOUND, str(exc))
        rid = step.request_id
        if rid:
            stored = session.results.get(rid)
            if stored is not None:
                return self.scheduler.answered(step, stored)
            if rid in session.inflight:
                return self.scheduler.join(session.inflight[rid])
        return self.scheduler.submit(step, session, drafts, draft_probs)

    async def _reap(self, timeout_s: float) -> None:
        interval = min(1.0, timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for session in self.sessions.idle(timeout_s):
                self.sessions.remove(session.id, f"reaped after {timeout_s:g} s idle (idle_timeout_s)")
                self.worker.submit(self.engine.close, session.sequence)
                log.info("reaped session %s after %g s idle", session.id, timeout_s)


def _open(engine: Engine, prompt, sampling, max_new_tokens: int, want_logits: bool):
    """On the worker: admit and prefill, and the first token's logits row as wire bytes when asked."""
    seq = engine.open(prompt, sampling, max_new_tokens)
    return seq, logits_message(seq.first_logits[None]) if want_logits else None
