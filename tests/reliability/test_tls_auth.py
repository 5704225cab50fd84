"""TLS and bearer-token auth end to end: over TLS the right token steps
sessions bit-exactly, a missing or wrong token is UNAUTHENTICATED on every method, and health
checks are exempt; witness sessions with the right token never notice."""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier import rpc
from service.helpers import rpc_error

from .conftest import MAX_K, MAX_SEQ_LEN, VOCAB
from .witness import Witnesses

TOKEN = "s3cret-token"
GOOD = (("authorization", f"Bearer {TOKEN}"),)
BAD = [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),), (("authorization", f"Bearer {TOKEN}x"),)]


def test_token_over_tls(reliability_checkpoint, self_signed, plain_decode):
    from verifier.server.testing import LoopbackServer

    cert, key = self_signed
    with LoopbackServer(reliability_checkpoint, n_slots=6, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, auth_token=TOKEN,
                        tls_cert=cert, tls_key=key) as server:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(server.address, credentials) as channel:
            stub = rpc.VerifierStub(channel)
            with Witnesses(stub, plain_decode, metadata=GOOD):  # the right token over TLS works
                for metadata in BAD:
                    for call, request in [(stub.GetModelInfo, rpc.GetModelInfoRequest()),
                                          (stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[1], max_new_tokens=3)),
                                          (stub.Verify, rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id="x")])),
                                          (stub.CloseSession, rpc.CloseSessionRequest(session_id="x")),
                                          (stub.GetStats, rpc.GetStatsRequest())]:
                        error = rpc_error(call, request, metadata=metadata, timeout=10)
                        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in error.details()
                    streamed = rpc_error(lambda: list(stub.VerifyStream(iter([rpc.VerifyStep(session_id="x")]), metadata=metadata)))
                    assert streamed.code() == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # exempt: no token
                assert stub.GetModelInfo(rpc.GetModelInfoRequest(), metadata=GOOD).vocab_size == VOCAB
            assert stub.GetStats(rpc.GetStatsRequest(), metadata=GOOD).free_slots == 6
        with grpc.insecure_channel(server.address) as plaintext:  # the right token without TLS: refused
            error = rpc_error(rpc.VerifierStub(plaintext).GetModelInfo, rpc.GetModelInfoRequest(), metadata=GOOD, timeout=5)
            assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
