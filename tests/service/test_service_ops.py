"""Operations: health checking, reflection, bearer-token auth, TLS, message size, Prometheus
metrics, and draining."""

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from verifier import rpc
from verifier.server.testing import LoopbackServer

from .helpers import open_session, rpc_error, verify_one

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(channel, service=""):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def test_health_serving(server):
    with grpc.insecure_channel(server.address) as channel:
        assert _health(channel) == SERVING and _health(channel, rpc.SERVICE_NAME) == SERVING
        with pytest.raises(grpc.RpcError) as info:
            _health(channel, "no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=rpc.SERVICE_NAME)]
        listed, described = list(stub.ServerReflectionInfo(iter(requests)))
    names = {s.name for s in listed.list_services_response.service}
    assert {rpc.SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
            "grpc.reflection.v1.ServerReflection"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    assert files and any(b"verifier.v1" in f and b"VerifyStream" in f for f in files)


def test_reflection_v1_answers_as_v1alpha(server):
    """grpc.reflection.v1 (what current tools ask first): the same messages under another package."""
    with grpc.insecure_channel(server.address) as channel:
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        (described,) = list(info(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=rpc.SERVICE_NAME)])))
    files = described.file_descriptor_response.file_descriptor_proto
    assert files and any(b"verifier.v1" in f and b"VerifyStream" in f for f in files)


def test_metrics_endpoint_shows_the_stats(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=64, max_k=4, metrics_port=0) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = open_session(stub, [1, 2, 3], 10)
            verify_one(stub, opened.session_id, opened.position, [4, 5])
            verify_one(stub, "unknown", 0)
            stats = stub.GetStats(rpc.GetStatsRequest())
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values["verifier_steps_total"] == stats.steps == 1
    assert values["verifier_draft_tokens_total"] == stats.draft_tokens == 2
    assert values["verifier_accepted_tokens_total"] == stats.accepted_tokens
    assert values['verifier_drafted_per_position_total{position="2"}'] == stats.drafted_per_position[1] == 1
    assert values['verifier_step_errors_total{code="NOT_FOUND"}'] == stats.errors == 1
    assert values["verifier_rows_per_batch_count"] == stats.rows_per_batch.count == 1
    assert values["verifier_step_latency_seconds_count"] == stats.step_latency_ms.count == 1
    assert values["verifier_open_sessions"] == stats.open_sessions == 1


def test_auth_token(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=1, max_seq_len=32, max_k=2, auth_token="s3cret") as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            for metadata in [None, (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)]:
                error = rpc_error(stub.GetModelInfo, rpc.GetModelInfoRequest(), metadata=metadata)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in error.details()
            streamed = rpc_error(lambda: list(stub.VerifyStream(iter([rpc.VerifyStep(session_id="x")]))))
            assert streamed.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", "Bearer s3cret"),)
            assert stub.GetModelInfo(rpc.GetModelInfoRequest(), metadata=good).vocab_size == 90
            opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1], max_new_tokens=3), metadata=good)
            (result,) = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=opened.session_id, expected_position=1)]),
                                    metadata=good).results
            assert result.status.code == 0
            assert _health(channel) == SERVING  # health is exempt


def test_message_size_limit(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=1, max_seq_len=32, max_k=2, max_message_mb=0.001) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            error = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[60] * 2000, max_new_tokens=3))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert stub.GetModelInfo(rpc.GetModelInfoRequest()).max_k == 2  # small messages pass


def test_tls(text_checkpoint, self_signed):
    cert, key = self_signed
    with LoopbackServer(text_checkpoint, n_slots=1, max_seq_len=32, max_k=2, tls_cert=cert, tls_key=key) as server:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(server.address, credentials) as channel:
            assert rpc.VerifierStub(channel).GetModelInfo(rpc.GetModelInfoRequest()).vocab_size == 90
        with grpc.insecure_channel(server.address) as channel:  # plaintext is refused
            assert rpc_error(rpc.VerifierStub(channel).GetModelInfo, rpc.GetModelInfoRequest(), timeout=5).code() in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_draining_then_stop(text_checkpoint):
    server = LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=32, max_k=2)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = open_session(stub, [1, 2], 10)
            server.drain()
            assert _health(channel) == NOT_SERVING and _health(channel, rpc.SERVICE_NAME) == NOT_SERVING
            refused = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[3], max_new_tokens=3))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.details()
            # open sessions keep stepping while the server drains
            assert verify_one(stub, opened.session_id, opened.position).status.code == 0
            server.stop()
            after = rpc_error(stub.GetModelInfo, rpc.GetModelInfoRequest(), timeout=5)
            assert after.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_requests_over_what_the_server_can_need_are_refused_unread(server, stub):
    """The default request limit is the largest request this server's shape can use (1 MiB here);
    a larger one is RESOURCE_EXHAUSTED from its length prefix, and the server goes on."""
    from verifier.server.app import MIN_REQUEST_BYTES

    assert server.server.request_limit == MIN_REQUEST_BYTES
    error = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[5] * (2 << 20), max_new_tokens=3), timeout=10)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    opened = open_session(stub, [1, 2, 3], 4)
    assert verify_one(stub, opened.session_id, opened.position).status.code == 0
