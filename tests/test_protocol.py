"""The wire protocol: the committed generated code matches proto/, `verifier.rpc` exports it, and the stub
and servicer handler built from the service's descriptor talk over sync and grpc.aio servers."""

import asyncio
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pool

from verifier import rpc
from verifier.rpc import build
from verifier.v1 import verifier_pb2


def test_generated_code_matches_proto():
    """Regenerates with the pinned grpcio-tools (installed on first use: fails, never skips, without it)."""
    assert build.stale_files() == [], "generated wire code is stale: run python -m verifier.rpc.build"


def test_generated_code_carries_no_version_gate():
    """Why the generator is pinned: newer protoc gencode checks the protobuf runtime's version. No grpc
    gencode is committed (newer releases' checks grpcio's version and passes `_registered_method`, a
    TypeError on grpcio 1.60): the service's code is built from its descriptor."""
    messages = (build.ROOT / "verifier/v1/verifier_pb2.py").read_text()
    assert "runtime_version" not in messages
    assert build.GENERATED == ("verifier/v1/verifier_pb2.py", "verifier/v1/verifier_pb2.pyi")
    assert not (build.ROOT / "verifier/v1/verifier_pb2_grpc.py").exists()


def test_exports_are_the_generated_code():
    assert rpc.VerifyStep is verifier_pb2.VerifyStep and rpc.StepResult is verifier_pb2.StepResult
    assert (rpc.FINISH_NONE, rpc.FINISH_EOS, rpc.FINISH_LENGTH) == (0, 1, 2)
    assert (rpc.PACKAGE, rpc.SERVICE_NAME, rpc.PROTOCOL_VERSION) == ("verifier.v1", "verifier.v1.Verifier", "verifier.v1")
    # server reflection reads the default pool: the file must be there under its proto path
    pool = descriptor_pool.Default()
    assert pool.FindFileByName("verifier/v1/verifier.proto").package == "verifier.v1"
    assert {method.name for method in pool.FindServiceByName(rpc.SERVICE_NAME).methods} == {
        "GetModelInfo", "OpenSession", "Verify", "VerifyStream", "VerifyRounds", "CloseSession", "GetStats", "Generate"}


class _RecordingChannel:
    """Stands in for a channel: records what the stub asks it to make."""

    def __init__(self) -> None:
        self.made: dict[str, tuple] = {}

    def __getattr__(self, kind):
        def make(path, request_serializer, response_deserializer):
            self.made[path] = (kind, request_serializer, response_deserializer)
            return path
        return make


# Every RPC of the proto as the generated code spelled it: name, kind, request and response classes.
_METHODS = [
    ("GetModelInfo", "unary_unary", rpc.GetModelInfoRequest, rpc.ModelInfo),
    ("OpenSession", "unary_unary", rpc.OpenSessionRequest, rpc.OpenSessionResponse),
    ("Verify", "unary_unary", rpc.VerifyRequest, rpc.VerifyResponse),
    ("VerifyStream", "stream_stream", rpc.VerifyStep, rpc.StepResult),
    ("VerifyRounds", "stream_stream", rpc.VerifyRequest, rpc.VerifyResponse),
    ("CloseSession", "unary_unary", rpc.CloseSessionRequest, rpc.CloseSessionResponse),
    ("GetStats", "unary_unary", rpc.GetStatsRequest, rpc.Stats),
    ("Generate", "unary_stream", rpc.GenerateRequest, rpc.GenerateEvent),
]


def test_stub_and_handler_follow_the_descriptor():
    """The stub's callables and the server's handlers: each RPC's path, kind and message classes."""
    channel = _RecordingChannel()
    stub = rpc.VerifierStub(channel)
    assert channel.made == {f"/verifier.v1.Verifier/{name}": (kind, request.SerializeToString, response.FromString)
                            for name, kind, request, response in _METHODS}
    assert all(getattr(stub, name) == f"/verifier.v1.Verifier/{name}" for name, *_ in _METHODS)

    servicer = _Echo()
    handler = rpc.servicer_handler(servicer)
    for name, kind, request, response in _METHODS:
        method = handler.service(_CallDetails(f"/verifier.v1.Verifier/{name}"))
        assert (method.request_streaming, method.response_streaming) == (kind.startswith("stream"), kind.endswith("_stream"))
        assert method.request_deserializer == request.FromString
        assert method.response_serializer == response.SerializeToString
        assert getattr(method, kind) == getattr(servicer, name)
    assert handler.service(_CallDetails("/verifier.v1.Verifier/Nope")) is None  # grpc answers UNIMPLEMENTED


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method, self.invocation_metadata = method, ()


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

    async def VerifyRounds(self, requests, context):
        async for request in requests:
            yield rpc.VerifyResponse(results=[rpc.StepResult(session_id=s.session_id, accepted=len(s.draft_ids))
                                              for s in request.steps])

    async def CloseSession(self, request, context):
        return rpc.CloseSessionResponse(closed=False)

    async def GetStats(self, request, context):
        return rpc.Stats(steps=7)

    async def Generate(self, request, context):
        yield rpc.GenerateEvent(opened=rpc.OpenSessionResponse(session_id="g", prompt_ids=request.open.prompt_ids))
        yield rpc.GenerateEvent(step=rpc.StepResult(session_id="g", tokens=[6]))


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
                rounds = [rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id="a", draft_ids=[1] * k)]) for k in (2, 0, 1)]
                assert [r.results[0].accepted async for r in stub.VerifyRounds(iter(rounds))] == [2, 0, 1]
                assert (await stub.CloseSession(rpc.CloseSessionRequest(session_id="a"))).closed is False
                assert (await stub.GetStats(rpc.GetStatsRequest())).steps == 7
                events = [e async for e in stub.Generate(rpc.GenerateRequest(open=rpc.OpenSessionRequest(prompt_ids=[2])))]
                assert [list(events[0].opened.prompt_ids), list(events[1].step.tokens)] == [[2], [6]]
        finally:
            await server.stop(None)

    asyncio.run(run())


class _SyncEcho:
    def GetModelInfo(self, request, context):
        return rpc.ModelInfo(vocab_size=13)

    def VerifyStream(self, steps, context):
        for step in steps:
            yield rpc.StepResult(session_id=step.session_id, accepted=len(step.draft_ids))

    def OpenSession(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    Verify = VerifyRounds = CloseSession = GetStats = Generate = OpenSession


def test_sync_server_and_stub():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([rpc.servicer_handler(_SyncEcho())])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.VerifierStub(channel)
            assert stub.GetModelInfo(rpc.GetModelInfoRequest(), timeout=10).vocab_size == 13
            with pytest.raises(grpc.RpcError) as err:
                stub.Verify(rpc.VerifyRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            steps = [rpc.VerifyStep(session_id="s", draft_ids=[1] * k) for k in (0, 2)]
            assert [r.accepted for r in stub.VerifyStream(iter(steps), timeout=10)] == [0, 2]
    finally:
        server.stop(None)
