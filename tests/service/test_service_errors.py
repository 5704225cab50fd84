"""Per-step status codes (DESIGN.md section 8): each bad step gets its own status, changes no
state, and never fails the other steps of its Verify call."""

import grpc
import numpy as np

from verifier import rpc

from .helpers import code_of, open_session, rpc_error, step, verify_one

PROMPT = [9, 8, 7, 6, 5]
VOCAB, MAX_K = 90, 8


def _probs(k, vocab=VOCAB, fill=None):
    probs = np.full((k, vocab), 1.0 / vocab, dtype=np.float32) if fill is None else np.full((k, vocab), fill, dtype=np.float32)
    return probs.astype("<f4").tobytes()


def test_bad_steps_get_their_status_and_change_nothing(stub, plain):
    expected = plain(PROMPT, 30)
    opened = open_session(stub, PROMPT, 30)
    sid, p = opened.session_id, opened.position
    cases = [
        (step(sid, p, [3, VOCAB]), grpc.StatusCode.INVALID_ARGUMENT, "draft_ids"),
        (step(sid, p, [3, -1]), grpc.StatusCode.INVALID_ARGUMENT, "draft_ids"),
        (step(sid, p, [1] * (MAX_K + 1)), grpc.StatusCode.INVALID_ARGUMENT, "max_k"),
        (step(sid, p, [1, 2], draft_probs=_probs(1)), grpc.StatusCode.INVALID_ARGUMENT, "draft_probs"),
        (step(sid, p, [1, 2], draft_probs=b"\x00\x00\x80"), grpc.StatusCode.INVALID_ARGUMENT, "draft_probs"),
        (step(sid, p, [1, 2], draft_probs=_probs(2, fill=0.5)), grpc.StatusCode.INVALID_ARGUMENT, "draft_probs"),
        (step(sid, p, [], draft_probs=_probs(1)), grpc.StatusCode.INVALID_ARGUMENT, "draft_probs"),
        (step("", p, [1]), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
        (step(sid, p + 1, [1]), grpc.StatusCode.ABORTED, "expected_position"),
        (step(sid, p - 1, [1]), grpc.StatusCode.ABORTED, "expected_position"),
    ]
    for request, code, field in cases:
        (result,) = stub.Verify(rpc.VerifyRequest(steps=[request])).results
        assert code_of(result) == code, (request, result.status.message)
        assert field in result.status.message, result.status.message
        assert not result.tokens
        if code == grpc.StatusCode.ABORTED:
            assert result.status.current_position == p
    # nothing moved: the first good step gives plain decoding's tokens
    good = verify_one(stub, sid, p, expected.tokens[1:4])
    assert good.status.code == 0 and list(good.tokens) == expected.tokens[1:5]
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


def test_one_bad_step_never_fails_the_others(stub, plain):
    a_expected, b_expected = plain(PROMPT, 20), plain([1, 2, 3], 20)
    a, b, c = open_session(stub, PROMPT, 20), open_session(stub, [1, 2, 3], 20), open_session(stub, [4], 20)
    steps = [
        step(a.session_id, a.position, a_expected.tokens[1:3]),
        step(b.session_id, b.position, [1] * (MAX_K + 1)),  # too many drafts
        step(a.session_id, a.position, [4]),  # the same session twice in one request
        step("unknown", 0, []),
        step(c.session_id, c.position + 5, []),  # stale
    ]
    results = stub.Verify(rpc.VerifyRequest(steps=steps)).results
    assert [code_of(r) for r in results] == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                                             grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                             grpc.StatusCode.ABORTED]
    assert "duplicates steps[0]" in results[2].status.message
    assert list(results[0].tokens) == a_expected.tokens[1:4]
    assert [r.session_id for r in results] == [s.session_id for s in steps]
    # b was never touched by its bad steps
    b_next = verify_one(stub, b.session_id, b.position, b_expected.tokens[1:2])
    assert list(b_next.tokens) == b_expected.tokens[1:3]
    for s in (a, b, c):
        stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))


def test_context_full(stub, plain):
    prompt = [11] * 94  # max_seq_len 96: room for two one-row steps
    opened = open_session(stub, prompt, 50)
    sid = opened.session_id
    too_long = verify_one(stub, sid, 94, [1, 2])  # 3 rows from 94 pass 96
    assert code_of(too_long) == grpc.StatusCode.OUT_OF_RANGE and "max_seq_len" in too_long.status.message
    first = verify_one(stub, sid, 94)
    assert first.status.code == 0 and first.position == 95 and first.finish_reason == rpc.FINISH_NONE
    last = verify_one(stub, sid, 95)
    # the context is full: the session ends with LENGTH, and a further step is refused
    assert last.status.code == 0 and last.position == 96 and last.finish_reason == rpc.FINISH_LENGTH
    assert [opened.first_token, *first.tokens, *last.tokens] == plain(prompt, 3).tokens
    after = verify_one(stub, sid, 96)
    assert code_of(after) == grpc.StatusCode.FAILED_PRECONDITION and "finished" in after.status.message
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


def test_finished_session_is_failed_precondition(stub):
    opened = open_session(stub, PROMPT, 1)  # the first token is the whole budget
    assert opened.finish_reason == rpc.FINISH_LENGTH
    result = verify_one(stub, opened.session_id, opened.position)
    assert code_of(result) == grpc.StatusCode.FAILED_PRECONDITION and "length" in result.status.message
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_errors_are_counted_by_stats(stub):
    before = stub.GetStats(rpc.GetStatsRequest()).errors
    verify_one(stub, "unknown", 0)
    verify_one(stub, "", 0)
    assert stub.GetStats(rpc.GetStatsRequest()).errors == before + 2


def test_a_request_of_more_steps_than_slots_is_refused_whole(server, stub):
    """Each step names a distinct session, so a request of more steps than slots is refused before
    any step is read: INVALID_ARGUMENT for the call (Verify) or the stream (VerifyRounds)."""
    n = server.config.n_slots + 1
    request = rpc.VerifyRequest(steps=[rpc.VerifyStep(session_id=f"s{i}") for i in range(n)])
    error = rpc_error(stub.Verify, request, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{n} steps in one request" in error.details()
    error = rpc_error(lambda: list(stub.VerifyRounds(iter([request]), timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "n_slots" in error.details()
    opened = open_session(stub, [1, 2, 3], 4)  # the server goes on
    assert verify_one(stub, opened.session_id, opened.position).status.code == 0
