"""The drafter's client of the verifier service (proto/verifier/v1/verifier.proto), blocking.

    with VerifierClient("127.0.0.1:50051") as client:
        info = client.model_info()
        session = client.open_session(prompt_ids=[1, 2, 3], max_new_tokens=32)
        outcome = client.step(Step(session.id, session.position, draft_ids=(5, 6)))
        client.close_session(session.id)

`AsyncVerifierClient` (drafter/aio_client.py, re-exported here) is the same over grpc.aio.
Every call carries the bearer token when there is one and a deadline of `timeout_s`. A call or a
step that fails with UNAVAILABLE or DEADLINE_EXCEEDED is resent with the SAME request id (bounded,
with backoff): the server's idempotency makes that safe. Other failures raise VerifierError.
What to resend and when is decided in drafter/retry.py; this module only carries it out.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from verifier import rpc
from verifier.params import SamplingParams

from . import retry
from .aio_client import AsyncStepStream, AsyncVerifierClient
from .channel import ClientChannel, call_error, stream_ended_error, stream_silent_error
from .messages import ModelInfo, Session, Stats, Step, StepOutcome, VerifierError, open_request
from .retry import Call, Decisions, Plan, RetryPolicy, Wait

__all__ = ["VerifierClient", "StepStream", "RoundStream", "AsyncVerifierClient", "AsyncStepStream", "RetryPolicy", "VerifierError",
           "SamplingParams", "Session", "Step", "StepOutcome", "ModelInfo", "Stats"]


def carry_out(decisions: Decisions, send):
    """Carry out an operation of drafter/retry.py blocking: sleep where it waits, `send(action)` where
    it calls or streams; its result."""
    plan = Plan(decisions)
    for action in plan:
        if isinstance(action, Wait):
            time.sleep(action.seconds)
        else:
            plan.reply(send(action))
    return plan.result


class VerifierClient(ClientChannel):
    """Blocking calls; the constructor's arguments are ClientChannel's (drafter/channel.py)."""

    def __enter__(self) -> "VerifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _send(self, call: Call):
        """One try of a unary call: its reply, or the VerifierError it failed with."""
        try:
            return self._invoke(call)
        except grpc.RpcError as err:
            return call_error(err, self.connection.address)

    def _call(self, method: str, request):
        return carry_out(retry.unary(self.retry, method, request), self._send)

    def model_info(self) -> ModelInfo:
        return ModelInfo.from_proto(self._call("GetModelInfo", rpc.GetModelInfoRequest()))

    def open_session(self, prompt_ids: list[int] | None = None, text: str | None = None, *,
                     sampling: SamplingParams = SamplingParams(), max_new_tokens: int, request_id: str | None = None,
                     return_logits: bool = False, verify_all_drafts: bool = False,
                     server_drafter: str = "", server_draft_k: int = 0) -> Session:
        """Admit a slot, prefill, choose the first token. A full pool raises VerifierError
        RESOURCE_EXHAUSTED with `retry_after_s`. `verify_all_drafts`: the server verifies every
        draft of the session's steps (no goodput trimming), as a drafter's measurement needs.
        `server_drafter` (one of ModelInfo.server_drafters): the server drafts `server_draft_k`
        per step for the session (0: its max_k), whose steps then carry no drafts."""
        request = open_request(prompt_ids, text, sampling, max_new_tokens, request_id, return_logits, verify_all_drafts,
                               server_drafter, server_draft_k)
        return Session.from_proto(self._call("OpenSession", request))

    def generate(self, prompt_ids: list[int] | None = None, text: str | None = None, *,
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int, request_id: str | None = None,
                 return_logits: bool = False, verify_all_drafts: bool = False, server_drafter: str,
                 server_draft_k: int = 0) -> "GenerateCall":
        """A session the server drafts for, run by the server to its end (the Generate call): the
        returned call's `session` is the opening, iterating it gives each step's outcome as the server
        streams it. The server closes the session when the call ends; `cancel()` ends it early. Not
        retried: a call that breaks midway has closed its session, and what was streamed is final."""
        request = open_request(prompt_ids, text, sampling, max_new_tokens, request_id, return_logits, verify_all_drafts,
                               server_drafter, server_draft_k)
        return GenerateCall(self, rpc.GenerateRequest(open=request))

    def verify(self, steps: list[Step]) -> list[StepOutcome]:
        """Steps of distinct sessions, run as one engine batch: one outcome per step, in order, each with
        its own status (check `.ok`, or `.check()` to raise). Steps whose status is UNAVAILABLE or
        DEADLINE_EXCEEDED are resent, alone, with the same request ids."""
        return carry_out(retry.verify(self.retry, steps), self._send)

    def step(self, step: Step) -> StepOutcome:
        """One step through Verify; a non-OK status raises VerifierError."""
        return self.verify([step])[0].check()

    def verify_stream(self) -> "StepStream":
        """A VerifyStream for one drafter: `stream.step(step)` sends a step and returns its outcome."""
        return StepStream(self)

    def verify_rounds(self) -> "RoundStream":
        """A VerifyRounds stream for a drafter of many sessions: `rounds.verify(steps)` is `verify`."""
        return RoundStream(self)

    def close_session(self, session_id: str) -> bool:
        """Free the session's slot; False when it was unknown or already closed (idempotent)."""
        return self._call("CloseSession", rpc.CloseSessionRequest(session_id=session_id)).closed

    def stats(self) -> Stats:
        return self._call("GetStats", rpc.GetStatsRequest())


_CLOSE = object()  # ends the request iterator: the client is done writing


class _MessageStream:
    """One bidirectional stream of `method`, blocking: each request waits for its reply, which comes
    in the order requests go. A broken stream (UNAVAILABLE, or no reply within the client's
    timeout) is dropped, so that the next request reopens it."""

    method = ""

    def __init__(self, client: VerifierClient):
        self._client = client
        self._call = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> None:
        requests: queue.Queue = queue.Queue()
        results: queue.Queue = queue.Queue()
        call = getattr(self._client._stub, self.method)(iter(requests.get, _CLOSE), metadata=self._client.connection.metadata)

        def read() -> None:  # a thread, so that waiting for a reply can time out
            try:
                for result in call:
                    results.put(result)
                results.put(None)
            except grpc.RpcError as err:
                results.put(err)

        threading.Thread(target=read, daemon=True, name=f"{self.method}-reader").start()
        self._call, self._requests, self._results = call, requests, results

    def _reset(self) -> None:
        if self._call is not None:
            self._requests.put(_CLOSE)
            self._call.cancel()
            self._call = None

    def _exchange(self, request):
        """One try of a request on the stream (opened first if need be): its reply, or a
        VerifierError after which the broken stream is dropped, so that a resend reopens it."""
        if self._call is None:
            self._open()
        self._requests.put(request)
        try:
            got = self._results.get(timeout=self._client.timeout_s)
        except queue.Empty:
            got = stream_silent_error(self._client.timeout_s)
        if got is None:
            got = stream_ended_error()
        elif isinstance(got, grpc.RpcError):
            got = call_error(got, self._client.connection.address)
        if isinstance(got, VerifierError):
            self._reset()
        return got

    def close(self) -> None:
        """Half-close the stream: the server ends it once it has answered every request."""
        if self._call is not None:
            self._requests.put(_CLOSE)
            self._call = None


class GenerateCall:
    """A Generate call in flight: `session` (the first event), then iterate for StepOutcomes."""

    def __init__(self, client: VerifierClient, request):
        self._address = client.connection.address
        self._call = client._stub.Generate(request, metadata=client.connection.metadata)
        first = self._next()
        if first is None or not first.HasField("opened"):
            self.cancel()
            raise VerifierError(grpc.StatusCode.INTERNAL, "inconsistent reply from the verifier: Generate's first event "
                                                          "is not the session's opening")
        self.session = Session.from_proto(first.opened)

    def _next(self):
        try:
            return next(self._call)
        except StopIteration:
            return None
        except grpc.RpcError as err:
            raise call_error(err, self._address) from None

    def __iter__(self):
        return self

    def __next__(self) -> StepOutcome:
        event = self._next()
        if event is None:
            raise StopIteration
        return StepOutcome.from_proto(event.step)

    def cancel(self) -> None:
        self._call.cancel()


class StepStream(_MessageStream):
    """One drafter's VerifyStream: `step()` is a plain call. A step on a broken stream is resent with
    the same request id on a new one."""

    method = "VerifyStream"

    def step(self, step: Step) -> StepOutcome:
        """Send one step and return its outcome; a non-OK status raises VerifierError."""
        return carry_out(retry.stream_step(self._client.retry, step), lambda send: self._exchange(send.request))


class RoundStream(_MessageStream):
    """A multi-session drafter's VerifyRounds: `verify(steps)` is VerifierClient.verify over one stream
    (one call's setup for every round, where Verify pays it each round). Retries are Verify's: a
    round on a broken stream is resent with the same request ids on a new one; steps with a
    retryable status are resent alone."""

    method = "VerifyRounds"

    def verify(self, steps: list[Step]) -> list[StepOutcome]:
        return carry_out(retry.verify(self._client.retry, steps), lambda call: self._exchange(call.request))
