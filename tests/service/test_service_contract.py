"""The contract's corners (DESIGN.md section 8): a request id reused with other content,
how many results a session keeps for retries, the position of an error result, `accepted` at a
budget cut, and state checked once per step."""

import grpc
import numpy as np
import pytest

from verifier import rpc
from verifier.engine import Engine
from verifier.server.testing import LoopbackServer

from .helpers import code_of, open_session, rpc_error, step, verify_one

PROMPT = [21, 4, 58, 9, 33]
VOCAB, MAX_K = 90, 8


def _uniform_probs(k: int) -> bytes:
    return np.full((k, VOCAB), 1.0 / VOCAB, dtype="<f4").tobytes()


def test_step_request_id_reused_with_other_content_is_invalid_argument(stub, plain):
    expected = plain(PROMPT, 30)
    opened = open_session(stub, PROMPT, 30)
    sid, p = opened.session_id, opened.position
    drafts = expected.tokens[1:3]
    first = verify_one(stub, sid, p, drafts, request_id="r1")
    assert first.status.code == 0
    others = [
        dict(position=p, drafts=drafts[:1]),  # other drafts
        dict(position=first.position, drafts=drafts),  # other expected position
        dict(position=p, drafts=drafts, draft_probs=_uniform_probs(2)),  # probabilities added
        dict(position=p, drafts=drafts, return_logits=True),  # the logits flag
    ]
    for fields in others:
        result = verify_one(stub, sid, fields.pop("position"), fields.pop("drafts"), request_id="r1", **fields)
        assert code_of(result) == grpc.StatusCode.INVALID_ARGUMENT and "'r1'" in result.status.message, result.status.message
        assert not result.tokens and result.position == first.position
    # the same content is still a retry: the stored result, the session advanced once
    again = verify_one(stub, sid, p, drafts, request_id="r1")
    assert again.SerializeToString() == first.SerializeToString()
    nxt = verify_one(stub, sid, first.position, request_id="r2")
    assert nxt.status.code == 0 and list(nxt.tokens) == expected.tokens[4:5]
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


def test_open_request_id_reused_with_other_content_is_invalid_argument(stub):
    first = open_session(stub, PROMPT, 5, request_id="open-reuse")
    others = [
        dict(prompt_ids=PROMPT + [1], max_new_tokens=5),
        dict(text="ABC", max_new_tokens=5),
        dict(prompt_ids=PROMPT, max_new_tokens=6),
        dict(prompt_ids=PROMPT, max_new_tokens=5, sampling=rpc.Sampling(temperature=0.5, seed=3)),
    ]
    free = stub.GetStats(rpc.GetStatsRequest()).free_slots
    for fields in others:
        error = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(request_id="open-reuse", **fields))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'open-reuse'" in error.details(), error.details()
    assert stub.GetStats(rpc.GetStatsRequest()).free_slots == free  # nothing admitted
    again = open_session(stub, PROMPT, 5, request_id="open-reuse")
    assert again.SerializeToString() == first.SerializeToString()
    stub.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id))


def test_results_kept_for_retries_is_a_server_option(text_checkpoint):
    """results_per_session=2: the last two results answer retries; an older request id is no
    longer known, so its retry is a new step, stale by then (ABORTED), never a second advance."""
    with LoopbackServer(text_checkpoint, n_slots=1, max_seq_len=64, results_per_session=2) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = open_session(stub, PROMPT, 20)
            position, answers = opened.position, []
            for i in range(3):
                answers.append(verify_one(stub, opened.session_id, position, request_id=f"s{i}"))
                position = answers[-1].position
            for i in (1, 2):
                retry = verify_one(stub, opened.session_id, answers[i - 1].position, request_id=f"s{i}")
                assert retry.SerializeToString() == answers[i].SerializeToString()
            forgotten = verify_one(stub, opened.session_id, opened.position, request_id="s0")
            assert code_of(forgotten) == grpc.StatusCode.ABORTED and forgotten.position == position


def test_error_results_carry_the_current_position(stub, plain):
    """Every error result of a session the server holds says where that session is; one the server
    does not hold (unknown, closed, no session_id) says 0."""
    expected = plain(PROMPT, 30)
    opened = open_session(stub, PROMPT, 30)
    sid = opened.session_id
    moved = verify_one(stub, sid, opened.position, expected.tokens[1:3])
    p = moved.position
    singles = [
        (step(sid, p, [3, VOCAB]), grpc.StatusCode.INVALID_ARGUMENT),
        (step(sid, p, [1] * (MAX_K + 1)), grpc.StatusCode.INVALID_ARGUMENT),
        (step(sid, p, [1], draft_probs=_uniform_probs(2)), grpc.StatusCode.INVALID_ARGUMENT),
        (step(sid, p - 1), grpc.StatusCode.ABORTED),
    ]
    for request, code in singles:
        (result,) = stub.Verify(rpc.VerifyRequest(steps=[request])).results
        assert code_of(result) == code and result.position == p, (result.status.message, result.position)
    twice = stub.Verify(rpc.VerifyRequest(steps=[step(sid, p, [VOCAB]), step(sid, p)])).results
    assert [code_of(r) for r in twice] == [grpc.StatusCode.INVALID_ARGUMENT] * 2 and [r.position for r in twice] == [p, p]
    for missing in ("no-such-session", ""):
        assert verify_one(stub, missing, 4).position == 0
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))
    assert code_of(closed := verify_one(stub, sid, p)) == grpc.StatusCode.NOT_FOUND and closed.position == 0

    long = open_session(stub, [11] * 90, 50)  # max_seq_len 96: 6 positions left
    too_long = verify_one(stub, long.session_id, long.position, [1] * 6)
    assert code_of(too_long) == grpc.StatusCode.OUT_OF_RANGE and too_long.position == 90
    stub.CloseSession(rpc.CloseSessionRequest(session_id=long.session_id))
    done = open_session(stub, PROMPT, 1)  # finished at once
    finished = verify_one(stub, done.session_id, done.position)
    assert code_of(finished) == grpc.StatusCode.FAILED_PRECONDITION and finished.position == len(PROMPT)
    stub.CloseSession(rpc.CloseSessionRequest(session_id=done.session_id))


def test_accepted_counts_the_drafts_before_a_budget_cut(stub, plain):
    """8 right drafts with room for 2 more tokens: accepted is 8, tokens hold 2 (fewer than accepted + 1)."""
    right = plain(PROMPT, 12).tokens[1:9]
    opened = open_session(stub, PROMPT, 3)
    result = verify_one(stub, opened.session_id, opened.position, right)
    assert result.status.code == 0 and result.accepted == 8
    assert list(result.tokens) == right[:2] and result.finish_reason == rpc.FINISH_LENGTH
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


class CountingEngine(Engine):
    """Counts the engine's state checks."""

    checks = 0

    def check(self, request):
        CountingEngine.checks += 1
        return super().check(request)


def test_state_is_checked_once_per_step(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=64, engine_class=CountingEngine) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            a, b = open_session(stub, PROMPT, 20), open_session(stub, [1, 2], 20)
            CountingEngine.checks = 0
            results = stub.Verify(rpc.VerifyRequest(steps=[step(a.session_id, a.position, [3]),
                                                           step(b.session_id, b.position)])).results
            assert [r.status.code for r in results] == [0, 0]
            assert CountingEngine.checks == 2


@pytest.mark.parametrize("bad", ["nan", "own-draft-zero"])
def test_draft_probs_values_are_checked_on_the_wire(stub, bad):
    probs = np.full((1, VOCAB), 1.0 / VOCAB, dtype="<f4")
    if bad == "nan":
        probs[0, 5] = np.nan
    else:
        probs[:] = 0.0
        probs[0, 2] = 1.0  # the draft is 1
    opened = open_session(stub, PROMPT, 10)
    result = verify_one(stub, opened.session_id, opened.position, [1], draft_probs=probs.tobytes())
    assert code_of(result) == grpc.StatusCode.INVALID_ARGUMENT and "draft_probs" in result.status.message
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))
