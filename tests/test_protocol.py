"""The wire protocol: the committed descriptor matches proto/, and stubs and servicers built from it talk."""

import asyncio

import grpc
import pytest

from verifier import rpc
from verifier.rpc import build


def test_descriptor_module_matches_proto():
    assert build.is_current(), "verifier/rpc/descriptor_set.py is stale: run python -m verifier.rpc.build"


def test_messages_round_trip():
    step = rpc.VerifyStep(session_id="s1", expected_position=7, draft_ids=[3, -1, 2**31 - 1], request_id="r",
                          draft_probs=b"\x00\x00\x80?")
    assert rpc.VerifyStep.FromString(step.SerializeToString()) == step
    result = rpc.StepResult(status=rpc.Status(code=grpc.StatusCode.ABORTED.value[0], current_position=9),
                            tokens=[1, 2], finish_reason=rpc.FINISH_EOS)
    assert rpc.StepResult.FromString(result.SerializeToString()).status.current_position == 9


def test_servicer_without_a_method_is_refused():
    class Partial:
        async def GetModelInfo(self, request, context):
            return rpc.ModelInfo()

    with pytest.raises(TypeError, match="does not implement OpenSession"):
        rpc.servicer_handler(Partial())


class _Echo:
    async def GetModelInfo(self, request, context):
        return rpc.ModelInfo(vocab_size=11, protocol_version=rpc.PROTOCOL_VERSION)

    async def OpenSession(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free slot")

    async def Verify(self, request, context):
        return rpc.VerifyResponse(results=[rpc.StepResult(session_id=s.session_id, tokens=s.draft_ids) for s in request.steps])

    async def VerifyStream(self, steps, context):
        async for step in steps:
            yield rpc.StepResult(session_id=step.session_id, position=step.expected_position + 1)

    async def CloseSession(self, request, context):
        return rpc.CloseSessionResponse(closed=False)

    async def GetStats(self, request, context):
        return rpc.Stats()


def test_every_method_kind_over_loopback():
    async def run():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([rpc.servicer_handler(_Echo())])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.VerifierStub(channel)
                info = await stub.GetModelInfo(rpc.GetModelInfoRequest())
                assert (info.vocab_size, info.protocol_version) == (11, "verifier.v1")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1]))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                reply = await stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id="a", draft_ids=[4, 5])]))
                assert list(reply.results[0].tokens) == [4, 5]
                steps = [rpc.VerifyStep(session_id=str(i), expected_position=i) for i in range(3)]
                got = [(r.session_id, r.position) async for r in stub.VerifyStream(iter(steps))]
                assert got == [("0", 1), ("1", 2), ("2", 3)]
        finally:
            await server.stop(None)

    asyncio.run(run())
