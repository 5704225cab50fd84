"""Principals end to end: a session belongs to the principal that opened it (another principal
gets NOT_FOUND for it, worded as for an id never issued, and cannot close it), OpenSession
request ids are each principal's own, --max-sessions-per-principal caps one principal and not
the others, tokens come from a file or the environment, and client certificates name principals
under mutual TLS. Witness sessions of the owner step through all of it equal to plain decoding."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from verifier import rpc
from verifier.server.principals import TOKENS_ENV
from verifier.server.testing import LoopbackServer
from service.helpers import rpc_error

from .conftest import MAX_K, MAX_SEQ_LEN
from .witness import Witnesses

ALICE, BOB = (("authorization", "Bearer alice-token-1"),), (("authorization", "Bearer bob-token-2"),)


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# principal:token\nalice:alice-token-1\nbob:bob-token-2\n")
    return path


def _open(stub, metadata, request_id="", prompt=(1, 2, 3)):
    return stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=list(prompt), max_new_tokens=8, request_id=request_id),
                            metadata=metadata, timeout=30)


def _step(stub, metadata, session_id, position):
    (result,) = stub.Verify(rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=session_id, expected_position=position)]),
                            metadata=metadata, timeout=30).results
    return result


def test_a_session_is_its_openers_alone(reliability_checkpoint, plain_decode, tokens_file):
    with LoopbackServer(reliability_checkpoint, n_slots=8, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, auth_tokens_file=tokens_file) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            with Witnesses(stub, plain_decode, metadata=ALICE):
                mine = _open(stub, ALICE, request_id="open-1")
                never = _step(stub, BOB, "f" * 32, 0)
                theirs = _step(stub, BOB, mine.session_id, mine.position)
                assert theirs.status.code == never.status.code == grpc.StatusCode.NOT_FOUND.value[0]
                assert theirs.status.message == never.status.message.replace("f" * 32, mine.session_id)
                assert not stub.CloseSession(rpc.CloseSessionRequest(session_id=mine.session_id), metadata=BOB).closed
                # bob's open with alice's request id and content is bob's own new session, not alice's
                other = _open(stub, BOB, request_id="open-1")
                assert other.session_id != mine.session_id
                # alice's session is untouched: it steps from where it was
                assert _step(stub, ALICE, mine.session_id, mine.position).status.code == 0
                # a stream of bob's cannot step it either
                (streamed,) = list(stub.VerifyStream(iter([rpc.VerifyStep(session_id=mine.session_id, expected_position=mine.position + 1)]),
                                                     metadata=BOB, timeout=30))
                assert streamed.status.code == grpc.StatusCode.NOT_FOUND.value[0]
                assert stub.CloseSession(rpc.CloseSessionRequest(session_id=mine.session_id), metadata=ALICE).closed
                # once closed, bob still hears "not known", alice hears why
                gone_bob, gone_alice = _step(stub, BOB, mine.session_id, 0), _step(stub, ALICE, mine.session_id, 0)
                assert "not known" in gone_bob.status.message and "closed" in gone_alice.status.message
                assert stub.CloseSession(rpc.CloseSessionRequest(session_id=other.session_id), metadata=BOB).closed


def test_sessions_per_principal(reliability_checkpoint, tokens_file):
    with LoopbackServer(reliability_checkpoint, n_slots=4, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, auth_tokens_file=tokens_file,
                        max_sessions_per_principal=2) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            held = [_open(stub, ALICE), _open(stub, ALICE)]
            refused = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[1], max_new_tokens=3), metadata=ALICE, timeout=30)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "'alice' holds 2 sessions" in refused.details() and "--max-sessions-per-principal" in refused.details()
            assert dict(refused.trailing_metadata())[rpc.RETRY_AFTER_KEY].isdigit()
            bobs = [_open(stub, BOB), _open(stub, BOB)]  # the others' share is theirs
            stub.CloseSession(rpc.CloseSessionRequest(session_id=held[0].session_id), metadata=ALICE)
            held.append(_open(stub, ALICE))  # a closed one's place comes back
            stats = stub.GetStats(rpc.GetStatsRequest(), metadata=ALICE)
            assert stats.open_sessions == 4 and stats.free_slots == 0
            for session, who in [(held[1], ALICE), (held[2], ALICE), (bobs[0], BOB), (bobs[1], BOB)]:
                assert stub.CloseSession(rpc.CloseSessionRequest(session_id=session.session_id), metadata=who).closed
            assert stub.GetStats(rpc.GetStatsRequest(), metadata=BOB).free_slots == 4


def test_failing_steps_do_not_keep_a_session_alive(reliability_checkpoint):
    """Idle time counts from the last step answered OK: stale steps every 0.1 s do not hold the slot."""
    import time

    with LoopbackServer(reliability_checkpoint, n_slots=2, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, idle_timeout_s=0.8) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = _open(stub, None)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                result = _step(stub, None, opened.session_id, opened.position + 5)  # stale: ABORTED
                if result.status.code == grpc.StatusCode.NOT_FOUND.value[0]:
                    assert "reaped" in result.status.message
                    break
                assert result.status.code == grpc.StatusCode.ABORTED.value[0]
                time.sleep(0.1)
            else:
                pytest.fail("a session sent only failing steps was never reaped")
            assert stub.GetStats(rpc.GetStatsRequest()).free_slots == 2


def test_tokens_from_the_environment(reliability_checkpoint, monkeypatch):
    monkeypatch.setenv(TOKENS_ENV, "carol:carol-token-3,dave:dave-token-4")
    with LoopbackServer(reliability_checkpoint, n_slots=2, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            carol, dave = (("authorization", "Bearer carol-token-3"),), (("authorization", "Bearer dave-token-4"),)
            error = rpc_error(stub.GetModelInfo, rpc.GetModelInfoRequest(), timeout=10)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            opened = _open(stub, carol)
            assert _step(stub, dave, opened.session_id, opened.position).status.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert _step(stub, carol, opened.session_id, opened.position).status.code == 0


def _openssl(*args):
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


@pytest.fixture
def client_certificates(tmp_path):
    """(ca, {name: (cert, key)}): a test CA and client certificates it signed for alice and bob."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    ca, ca_key = tmp_path / "ca.pem", tmp_path / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout", ca_key, "-out", ca)
    clients = {}
    for name in ("alice", "bob"):
        key, csr, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.csr", tmp_path / f"{name}.pem"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", key, "-out", csr)
        _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1", "-out", cert)
        clients[name] = (cert, key)
    return ca, clients


def test_client_certificates_name_principals(reliability_checkpoint, self_signed, client_certificates):
    cert, key = self_signed
    ca, clients = client_certificates
    with LoopbackServer(reliability_checkpoint, n_slots=2, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, tls_cert=cert, tls_key=key,
                        tls_client_ca=ca) as server:
        def channel(name=None):
            chain, private = (clients[name][0].read_bytes(), clients[name][1].read_bytes()) if name else (None, None)
            credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes(), private_key=private,
                                                       certificate_chain=chain)
            return grpc.secure_channel(server.address, credentials)

        with channel() as anonymous:  # no client certificate: the handshake fails
            error = rpc_error(rpc.VerifierStub(anonymous).GetModelInfo, rpc.GetModelInfoRequest(), timeout=10)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        with channel("alice") as a, channel("bob") as b:
            alice, bob = rpc.VerifierStub(a), rpc.VerifierStub(b)
            opened = _open(alice, None)
            assert _step(bob, None, opened.session_id, opened.position).status.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert _step(alice, None, opened.session_id, opened.position).status.code == 0
