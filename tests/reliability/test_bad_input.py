"""Bad input on one session, among witness sessions that must not notice: each
case asserts its exact status code, that the faulty session itself did not move, and (on leaving
`Witnesses`) that every other session's tokens and logits bytes equal plain decoding."""

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier import rpc
from service.helpers import code_of, open_session, rpc_error, step, verify_one

from .conftest import MAX_K, MAX_SEQ_LEN, VOCAB
from .witness import Witnesses

PROMPT = [9, 8, 7, 6, 5]


@pytest.fixture(scope="module")
def channel(slow_server):
    server, _ = slow_server
    with grpc.insecure_channel(server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return rpc.VerifierStub(channel)


def _still_plain(stub, plain, opened, prompt=PROMPT, n=30):
    """The next good step from the session's opening position gives plain decoding's tokens."""
    expected = plain(prompt, n)
    result = verify_one(stub, opened.session_id, opened.position, expected.tokens[1:3], return_logits=True)
    assert result.status.code == 0, result.status.message
    assert list(result.tokens) == expected.tokens[1:4] and result.position == opened.position + 3
    rows = np.frombuffer(result.logits.float32, dtype="<f4")
    assert rows.tobytes() == expected.logits[1:4].numpy().astype("<f4").tobytes()
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


@pytest.mark.parametrize("drafts", [[3, VOCAB], [-1], [2, -(2 ** 31)], [2 ** 31 - 1]], ids=["vocab", "negative", "int32-min", "int32-max"])
def test_draft_ids_outside_the_vocabulary(stub, plain_decode, drafts):
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        result = verify_one(stub, opened.session_id, opened.position, drafts)
        assert code_of(result) == grpc.StatusCode.INVALID_ARGUMENT and "draft_ids" in result.status.message
        assert not result.tokens
        _still_plain(stub, plain_decode, opened)


@pytest.mark.parametrize("prompt", [[1, VOCAB], [1, -5]], ids=["vocab", "negative"])
def test_prompt_ids_outside_the_vocabulary(stub, plain_decode, prompt):
    with Witnesses(stub, plain_decode, recycle=False):  # fixed pool use: free slots compare
        free = stub.GetStats(rpc.GetStatsRequest()).free_slots
        error = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=prompt, max_new_tokens=4))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_ids" in error.details()
        assert stub.GetStats(rpc.GetStatsRequest()).free_slots == free


def test_k_over_max(stub, plain_decode):
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        result = verify_one(stub, opened.session_id, opened.position, [1] * (MAX_K + 1))
        assert code_of(result) == grpc.StatusCode.INVALID_ARGUMENT and "max_k" in result.status.message
        _still_plain(stub, plain_decode, opened)


def test_empty_draft_returns_the_bonus_only(stub, plain_decode):
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        result = verify_one(stub, opened.session_id, opened.position, [], return_logits=True)
        assert code_of(result) == grpc.StatusCode.OK
        assert result.accepted == 0 and list(result.tokens) == expected.tokens[1:2] and result.position == opened.position + 1
        assert result.logits.float32 == expected.logits[1:2].numpy().astype("<f4").tobytes()
        stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_step_past_the_context_length(stub, plain_decode):
    prompt = [11] * (MAX_SEQ_LEN - 2)  # room for two one-row steps
    expected = plain_decode(prompt, 3)
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, prompt, 50)
        too_long = verify_one(stub, opened.session_id, opened.position, [1, 2])  # 3 rows pass the end
        assert code_of(too_long) == grpc.StatusCode.OUT_OF_RANGE and "max_seq_len" in too_long.status.message
        first = verify_one(stub, opened.session_id, opened.position)
        last = verify_one(stub, opened.session_id, first.position)
        assert [opened.first_token, *first.tokens, *last.tokens] == expected.tokens
        assert last.position == MAX_SEQ_LEN and last.finish_reason == rpc.FINISH_LENGTH
        after = verify_one(stub, opened.session_id, last.position)
        assert code_of(after) == grpc.StatusCode.FAILED_PRECONDITION
        stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_unknown_session(stub, plain_decode):
    with Witnesses(stub, plain_decode):
        for sid in ("no-such-session", "x" * 5000, "\u00e9\u4e2d"):
            result = verify_one(stub, sid, 3, [1, 2])
            assert code_of(result) == grpc.StatusCode.NOT_FOUND and "session_id" in result.status.message
        assert not stub.CloseSession(rpc.CloseSessionRequest(session_id="no-such-session")).closed


def test_stale_expected_position(stub, plain_decode):
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        for position in (opened.position + 1, opened.position - 1, 0, 2 ** 64 - 1):
            result = verify_one(stub, opened.session_id, position, [1])
            assert code_of(result) == grpc.StatusCode.ABORTED and "expected_position" in result.status.message
            assert result.status.current_position == opened.position and not result.tokens
        _still_plain(stub, plain_decode, opened)


def test_replayed_request_id_same_reply_no_double_advance(stub, plain_decode):
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        request = rpc.VerifyRequest(steps=[step(opened.session_id, opened.position, expected.tokens[1:3], request_id="r-1",
                                                return_logits=True)])
        first = stub.Verify(request).results[0]
        replies = [stub.Verify(request).results[0] for _ in range(3)]
        assert first.status.code == 0 and list(first.tokens) == expected.tokens[1:4]
        assert all(r.SerializeToString() == first.SerializeToString() for r in replies)
        stale = verify_one(stub, opened.session_id, opened.position, request_id="r-2")
        assert code_of(stale) == grpc.StatusCode.ABORTED and stale.status.current_position == first.position
        nxt = verify_one(stub, opened.session_id, first.position, request_id="r-2")
        assert list(nxt.tokens) == expected.tokens[4:5] and nxt.position == first.position + 1
        stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_same_session_twice_in_one_batch(stub, plain_decode):
    expected = plain_decode(PROMPT, 30)
    with Witnesses(stub, plain_decode):
        opened = open_session(stub, PROMPT, 30)
        steps = [step(opened.session_id, opened.position, expected.tokens[1:3]),
                 step(opened.session_id, opened.position, [4, 4])]
        first, second = stub.Verify(rpc.VerifyRequest(steps=steps)).results
        assert code_of(first) == grpc.StatusCode.OK and list(first.tokens) == expected.tokens[1:4]
        assert code_of(second) == grpc.StatusCode.INVALID_ARGUMENT and "duplicates steps[0]" in second.status.message
        nxt = verify_one(stub, opened.session_id, first.position)  # advanced once, by the first
        assert list(nxt.tokens) == expected.tokens[4:5]
        stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_oversized_messages(stub, plain_decode):
    with Witnesses(stub, plain_decode, recycle=False):  # fixed pool use: free slots compare
        free = stub.GetStats(rpc.GetStatsRequest()).free_slots
        error = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[60] * 100000, max_new_tokens=3))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        opened = open_session(stub, PROMPT, 30)
        big = step(opened.session_id, opened.position, [1], draft_probs=b"\x00" * 80000)
        assert rpc_error(stub.Verify, rpc.VerifyRequest(steps=[big])).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        _still_plain(stub, plain_decode, opened)
        assert stub.GetStats(rpc.GetStatsRequest()).free_slots == free


METHODS = ["OpenSession", "Verify", "CloseSession", "GetModelInfo", "GetStats"]


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\x80" * 11, b"\x12\xff\xff\xff\xff\x0f"],
                         ids=["garbage", "truncated", "varint-overflow", "huge-length"])
def test_malformed_messages(channel, stub, plain_decode, payload):
    """Raw bytes that are not a valid message: INVALID_ARGUMENT or INTERNAL, never a crash."""
    with Witnesses(stub, plain_decode):
        for method in METHODS:
            call = channel.unary_unary(f"/{rpc.SERVICE_NAME}/{method}")  # no serializer: raw bytes go out
            error = rpc_error(call, payload, timeout=10)
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL), (method, error)
        for method in ("VerifyStream", "VerifyRounds"):
            stream = channel.stream_stream(f"/{rpc.SERVICE_NAME}/{method}")
            error = rpc_error(lambda: list(stream(iter([payload]), timeout=10)))
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL), (method, error)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.GetModelInfo(rpc.GetModelInfoRequest(), timeout=10).vocab_size == VOCAB
