"""The drafter's client of the verifier service over grpc.aio: the blocking client's methods as
coroutines, carrying out the same retry decisions (drafter/retry.py) with awaits and asyncio.sleep."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from verifier import rpc
from verifier.params import SamplingParams

from . import retry
from .channel import ClientChannel, call_error, stream_ended_error, stream_silent_error
from .messages import ModelInfo, Session, Stats, Step, StepOutcome, VerifierError, open_request
from .retry import Call, Decisions, Plan, StreamStep, Wait


async def carry_out(decisions: Decisions, send):
    """Carry out an operation of drafter/retry.py on the event loop: asyncio.sleep where it waits,
    `await send(action)` where it calls or streams; its result."""
    plan = Plan(decisions)
    for action in plan:
        if isinstance(action, Wait):
            await asyncio.sleep(action.seconds)
        else:
            plan.reply(await send(action))
    return plan.result


class AsyncVerifierClient(ClientChannel):
    """Create it inside a running event loop (grpc.aio channels belong to one loop); the constructor's
    arguments are ClientChannel's (drafter/channel.py)."""

    grpc_module = grpc.aio

    async def __aenter__(self) -> "AsyncVerifierClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _send(self, call: Call):
        """One try of a unary call: its reply, or the VerifierError it failed with."""
        try:
            return await self._invoke(call)
        except grpc.aio.AioRpcError as err:
            return call_error(err, self.connection.address)

    async def _call(self, method: str, request):
        return await carry_out(retry.unary(self.retry, method, request), self._send)

    async def model_info(self) -> ModelInfo:
        return ModelInfo.from_proto(await self._call("GetModelInfo", rpc.GetModelInfoRequest()))

    async def open_session(self, prompt_ids: list[int] | None = None, text: str | None = None, *,
                           sampling: SamplingParams = SamplingParams(), max_new_tokens: int,
                           request_id: str | None = None, return_logits: bool = False,
                           verify_all_drafts: bool = False, server_drafter: str = "",
                           server_draft_k: int = 0) -> Session:
        request = open_request(prompt_ids, text, sampling, max_new_tokens, request_id, return_logits, verify_all_drafts,
                               server_drafter, server_draft_k)
        return Session.from_proto(await self._call("OpenSession", request))

    async def verify(self, steps: list[Step]) -> list[StepOutcome]:
        """As VerifierClient.verify: one outcome per step, in order, each with its own status."""
        return await carry_out(retry.verify(self.retry, steps), self._send)

    async def step(self, step: Step) -> StepOutcome:
        """One step through Verify; a non-OK status raises VerifierError."""
        return (await self.verify([step]))[0].check()

    def verify_stream(self) -> "AsyncStepStream":
        return AsyncStepStream(self)

    async def close_session(self, session_id: str) -> bool:
        return (await self._call("CloseSession", rpc.CloseSessionRequest(session_id=session_id))).closed

    async def stats(self) -> Stats:
        return await self._call("GetStats", rpc.GetStatsRequest())


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

    async def _exchange(self, send: StreamStep):
        """One try of a step on the stream (opened first if need be): its rpc.StepResult, or a
        VerifierError after which the broken stream is dropped, so that a resend reopens it."""
        client = self._client
        if self._call is None:
            self._call = client._stub.VerifyStream(metadata=client.connection.metadata)
        try:
            await self._call.write(send.request)
            got = await asyncio.wait_for(self._call.read(), client.timeout_s)
        except grpc.aio.AioRpcError as err:
            got = call_error(err, client.connection.address)
        except asyncio.TimeoutError:
            got = stream_silent_error(client.timeout_s)
        if got is grpc.aio.EOF:
            got = stream_ended_error()
        if isinstance(got, VerifierError):
            self._call.cancel()
            self._call = None
        return got

    async def step(self, step: Step) -> StepOutcome:
        """Send one step and return its outcome; a non-OK status raises VerifierError."""
        return await carry_out(retry.stream_step(self._client.retry, step), self._exchange)

    async def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            try:
                await call.done_writing()
            except grpc.aio.AioRpcError:
                pass  # the stream already ended: nothing is left to half-close
