"""The drafter's client of the verifier service over grpc.aio: the blocking client's methods as
coroutines, with the same retries (same request id on UNAVAILABLE / DEADLINE_EXCEEDED)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio

from verifier import rpc

from .channel import RETRYABLE, Connection, RetryPolicy, call_error, check_result_count, with_request_id
from .messages import ModelInfo, Sampling, Session, Stats, Step, StepOutcome, VerifierError, open_request


class AsyncVerifierClient:
    """Create it inside a running event loop (grpc.aio channels belong to one loop)."""

    def __init__(self, address: str, *, auth_token: str | None = None, tls_root_cert: str | Path | None = None,
                 timeout_s: float = 60.0, retry: RetryPolicy = RetryPolicy(), max_message_bytes: int | None = None):
        extra = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        self.connection = Connection(address, auth_token, tls_root_cert, **extra)
        self.timeout_s = timeout_s
        self.retry = retry
        self._channel = self.connection.open(grpc.aio)
        self._stub = rpc.VerifierStub(self._channel)

    async def __aenter__(self) -> "AsyncVerifierClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request):
        for attempt in range(self.retry.attempts):
            try:
                return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self.connection.metadata)
            except grpc.aio.AioRpcError as err:
                if err.code() in RETRYABLE and attempt + 1 < self.retry.attempts:
                    await asyncio.sleep(self.retry.delay(attempt))
                    continue
                raise call_error(err, self.connection.address) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def model_info(self) -> ModelInfo:
        return ModelInfo.from_proto(await self._call("GetModelInfo", rpc.GetModelInfoRequest()))

    async def open_session(self, prompt_ids: list[int] | None = None, text: str | None = None, *,
                           sampling: Sampling = Sampling(), max_new_tokens: int, request_id: str | None = None,
                           return_logits: bool = False) -> Session:
        request = open_request(prompt_ids, text, sampling, max_new_tokens, request_id, return_logits)
        return Session.from_proto(await self._call("OpenSession", request))

    async def verify(self, steps: list[Step]) -> list[StepOutcome]:
        """As VerifierClient.verify: one outcome per step, in order, each with its own status."""
        steps = [with_request_id(s) for s in steps]
        outcomes: list[StepOutcome | None] = [None] * len(steps)
        todo = list(range(len(steps)))
        for attempt in range(self.retry.attempts):
            response = await self._call("Verify", rpc.VerifyRequest(steps=[steps[i].to_proto() for i in todo]))
            check_result_count(len(response.results), len(todo))
            for i, result in zip(todo, response.results):
                outcomes[i] = StepOutcome.from_proto(result)
            todo = [i for i in todo if outcomes[i].code in RETRYABLE]
            if not todo or attempt + 1 == self.retry.attempts:
                break
            await asyncio.sleep(self.retry.delay(attempt))
        return outcomes

    async def step(self, step: Step) -> StepOutcome:
        """One step through Verify; a non-OK status raises VerifierError."""
        return (await self.verify([step]))[0].check()

    def verify_stream(self) -> "AsyncStepStream":
        return AsyncStepStream(self)

    async def close_session(self, session_id: str) -> bool:
        return (await self._call("CloseSession", rpc.CloseSessionRequest(session_id=session_id))).closed

    async def stats(self) -> Stats:
        return Stats.from_proto(await self._call("GetStats", rpc.GetStatsRequest()))


class AsyncStepStream:
    """One drafter's VerifyStream over grpc.aio; `await stream.step(step)` sends a step and returns its
    outcome. A broken stream is reopened and the step resent with the same request id."""

    def __init__(self, client: AsyncVerifierClient):
        self._client = client
        self._call = None

    async def __aenter__(self) -> "AsyncStepStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def step(self, step: Step) -> StepOutcome:
        client, step = self._client, with_request_id(step)
        for attempt in range(client.retry.attempts):
            if self._call is None:
                self._call = client._stub.VerifyStream(metadata=client.connection.metadata)
            try:
                await self._call.write(step.to_proto())
                got = await asyncio.wait_for(self._call.read(), client.timeout_s)
                if got is grpc.aio.EOF:
                    raise VerifierError(grpc.StatusCode.UNAVAILABLE, "the server ended the VerifyStream")
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, VerifierError) as err:
                self._call.cancel()
                self._call = None
                if isinstance(err, asyncio.TimeoutError):
                    err = VerifierError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no VerifyStream result within {client.timeout_s} s")
                elif isinstance(err, grpc.aio.AioRpcError):
                    err = call_error(err, client.connection.address)
                if err.code in RETRYABLE and attempt + 1 < client.retry.attempts:
                    await asyncio.sleep(client.retry.delay(attempt))
                    continue
                raise err from None
            outcome = StepOutcome.from_proto(got)
            if outcome.code in RETRYABLE and attempt + 1 < client.retry.attempts:
                await asyncio.sleep(client.retry.delay(attempt))
                continue
            return outcome.check()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            try:
                await call.done_writing()
            except grpc.aio.AioRpcError:
                pass  # the stream already ended: nothing is left to half-close
