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
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import grpc

from verifier import rpc

from .aio_client import AsyncStepStream, AsyncVerifierClient
from .channel import RETRYABLE, Connection, RetryPolicy, call_error, check_result_count, with_request_id
from .messages import ModelInfo, Sampling, Session, Stats, Step, StepOutcome, VerifierError, open_request

__all__ = ["VerifierClient", "StepStream", "AsyncVerifierClient", "AsyncStepStream", "RetryPolicy", "VerifierError",
           "Sampling", "Session", "Step", "StepOutcome", "ModelInfo", "Stats"]


class VerifierClient:
    def __init__(self, address: str, *, auth_token: str | None = None, tls_root_cert: str | Path | None = None,
                 timeout_s: float = 60.0, retry: RetryPolicy = RetryPolicy(), max_message_bytes: int | None = None):
        extra = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        self.connection = Connection(address, auth_token, tls_root_cert, **extra)
        self.timeout_s = timeout_s
        self.retry = retry
        self._channel = self.connection.open(grpc)
        self._stub = rpc.VerifierStub(self._channel)

    def __enter__(self) -> "VerifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request):
        for attempt in range(self.retry.attempts):
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self.connection.metadata)
            except grpc.RpcError as err:
                if err.code() in RETRYABLE and attempt + 1 < self.retry.attempts:
                    time.sleep(self.retry.delay(attempt))
                    continue
                raise call_error(err, self.connection.address) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def model_info(self) -> ModelInfo:
        return ModelInfo.from_proto(self._call("GetModelInfo", rpc.GetModelInfoRequest()))

    def open_session(self, prompt_ids: list[int] | None = None, text: str | None = None, *,
                     sampling: Sampling = Sampling(), max_new_tokens: int, request_id: str | None = None,
                     return_logits: bool = False) -> Session:
        """Admit a slot, prefill, choose the first token. A full pool raises VerifierError
        RESOURCE_EXHAUSTED with `retry_after_s`."""
        request = open_request(prompt_ids, text, sampling, max_new_tokens, request_id, return_logits)
        return Session.from_proto(self._call("OpenSession", request))

    def verify(self, steps: list[Step]) -> list[StepOutcome]:
        """Steps of distinct sessions, run as one engine batch: one outcome per step, in order, each with
        its own status (check `.ok`, or `.check()` to raise). Steps whose status is UNAVAILABLE or
        DEADLINE_EXCEEDED are resent, alone, with the same request ids."""
        steps = [with_request_id(s) for s in steps]
        outcomes: list[StepOutcome | None] = [None] * len(steps)
        todo = list(range(len(steps)))
        for attempt in range(self.retry.attempts):
            response = self._call("Verify", rpc.VerifyRequest(steps=[steps[i].to_proto() for i in todo]))
            check_result_count(len(response.results), len(todo))
            for i, result in zip(todo, response.results):
                outcomes[i] = StepOutcome.from_proto(result)
            todo = [i for i in todo if outcomes[i].code in RETRYABLE]
            if not todo or attempt + 1 == self.retry.attempts:
                break
            time.sleep(self.retry.delay(attempt))
        return outcomes

    def step(self, step: Step) -> StepOutcome:
        """One step through Verify; a non-OK status raises VerifierError."""
        return self.verify([step])[0].check()

    def verify_stream(self) -> "StepStream":
        """A VerifyStream for one drafter: `stream.step(step)` sends a step and returns its outcome."""
        return StepStream(self)

    def close_session(self, session_id: str) -> bool:
        """Free the session's slot; False when it was unknown or already closed (idempotent)."""
        return self._call("CloseSession", rpc.CloseSessionRequest(session_id=session_id)).closed

    def stats(self) -> Stats:
        return Stats.from_proto(self._call("GetStats", rpc.GetStatsRequest()))


_CLOSE = object()  # ends the request iterator: the client is done writing


class StepStream:
    """One drafter's VerifyStream, blocking. Results come in the order steps go, and each step waits
    for its result, so `step()` is a plain call. A broken stream (UNAVAILABLE, or no result within the
    client's timeout) is reopened and the step resent with the same request id."""

    def __init__(self, client: VerifierClient):
        self._client = client
        self._call = None

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> None:
        requests: queue.Queue = queue.Queue()
        results: queue.Queue = queue.Queue()
        call = self._client._stub.VerifyStream(iter(requests.get, _CLOSE), metadata=self._client.connection.metadata)

        def read() -> None:  # a thread, so that waiting for a result can time out
            try:
                for result in call:
                    results.put(result)
                results.put(None)
            except grpc.RpcError as err:
                results.put(err)

        threading.Thread(target=read, daemon=True, name="verify-stream-reader").start()
        self._call, self._requests, self._results = call, requests, results

    def _reset(self) -> None:
        if self._call is not None:
            self._requests.put(_CLOSE)
            self._call.cancel()
            self._call = None

    def step(self, step: Step) -> StepOutcome:
        """Send one step and return its outcome; a non-OK status raises VerifierError."""
        client, step = self._client, with_request_id(step)
        for attempt in range(client.retry.attempts):
            if self._call is None:
                self._open()
            self._requests.put(step.to_proto())
            try:
                got = self._results.get(timeout=client.timeout_s)
            except queue.Empty:
                got = VerifierError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no VerifyStream result within {client.timeout_s} s")
            if got is None:
                got = VerifierError(grpc.StatusCode.UNAVAILABLE, "the server ended the VerifyStream")
            elif isinstance(got, grpc.RpcError):
                got = call_error(got, client.connection.address)
            if isinstance(got, VerifierError):
                self._reset()
                if got.code in RETRYABLE and attempt + 1 < client.retry.attempts:
                    time.sleep(client.retry.delay(attempt))
                    continue
                raise got
            outcome = StepOutcome.from_proto(got)
            if outcome.code in RETRYABLE and attempt + 1 < client.retry.attempts:
                time.sleep(client.retry.delay(attempt))
                continue
            return outcome.check()
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        """Half-close the stream: the server ends it once it has answered every step."""
        if self._call is not None:
            self._requests.put(_CLOSE)
            self._call = None
