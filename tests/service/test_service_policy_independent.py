"""What a step gets does not depend on the goodput policy's state: a step is judged against the
context on the drafts it sent, before any trimming, so the same request gets the same code with
trimming on or off; a session opened with verify_all_drafts gets every draft verified while the
policy trims the others of the same batch. The policy's choice is forced by the engine's step
costs (through the server's real construction path), not left to this machine's timing."""

import grpc
import pytest

from verifier import rpc
from verifier.engine import Engine
from verifier.server.testing import LoopbackServer

from .helpers import code_of, open_session, rpc_error, step, verify_one

MAX_SEQ_LEN, MAX_K = 16, 4


class NoDraftPays(Engine):
    """Every verify row past the first costs a thousand one-row steps: the policy trims every draft
    (no acceptance pays for such a row, and its probe credit never reaches one)."""

    def step_costs(self):
        return {rows: 1.0 + 1000.0 * (rows - 1) for rows in range(1, 65)}


def _serve(text_checkpoint, goodput: bool):
    return LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, engine_class=NoDraftPays,
                          goodput=goodput)


@pytest.mark.parametrize("goodput", [True, False], ids=["goodput", "no-goodput"])
def test_a_step_past_the_context_is_out_of_range_whatever_the_policy_would_trim(text_checkpoint, goodput):
    with _serve(text_checkpoint, goodput) as server, grpc.insecure_channel(server.address) as channel:
        stub = rpc.VerifierStub(channel)
        assert stub.GetModelInfo(rpc.GetModelInfoRequest()).trims_drafts is goodput
        # the policy is in force: a step with room for its draft gets it trimmed (goodput) or verified
        roomy = open_session(stub, [3, 4, 5], 8)
        result = verify_one(stub, roomy.session_id, roomy.position, [7])
        assert result.status.code == 0 and result.verified_drafts == (0 if goodput else 1)
        # a K=1 step at max_context - 1: two rows where one position is left
        full = open_session(stub, list(range(1, MAX_SEQ_LEN)), 8)
        assert full.position == MAX_SEQ_LEN - 1
        refused = verify_one(stub, full.session_id, full.position, [7], request_id="past")
        assert code_of(refused) == grpc.StatusCode.OUT_OF_RANGE, refused
        assert "2 rows from position 15 pass max_seq_len 16" in refused.status.message
        assert refused.position == full.position  # nothing changed
        # a decode step still fits: the refusal changed nothing, and the context now ends the session
        last = verify_one(stub, full.session_id, full.position)
        assert last.status.code == 0 and last.position == MAX_SEQ_LEN and last.finish_reason == rpc.FINISH_LENGTH


def test_a_verify_all_drafts_session_is_not_trimmed_beside_one_that_is(text_checkpoint):
    with _serve(text_checkpoint, goodput=True) as server, grpc.insecure_channel(server.address) as channel:
        stub = rpc.VerifierStub(channel)
        measured = open_session(stub, [3, 4, 5], 10, verify_all_drafts=True)
        served = open_session(stub, [3, 4, 5], 10)
        for _ in range(3):  # the same batch, every round: one session's drafts trimmed, the other's all verified
            results = stub.Verify(rpc.VerifyRequest(steps=[step(measured.session_id, measured.position, [9, 9, 9]),
                                                           step(served.session_id, served.position, [9, 9, 9])])).results
            assert [r.status.code for r in results] == [0, 0]
            assert [r.verified_drafts for r in results] == [3, 0], results
            measured, served = results
        stats = stub.GetStats(rpc.GetStatsRequest())
        assert stats.trimmed_drafts == 9 and stats.draft_tokens == 9


def test_verify_all_drafts_is_part_of_an_open_retry(text_checkpoint):
    with _serve(text_checkpoint, goodput=True) as server, grpc.insecure_channel(server.address) as channel:
        stub = rpc.VerifierStub(channel)
        first = open_session(stub, [3, 4], 5, request_id="open-1", verify_all_drafts=True)
        assert open_session(stub, [3, 4], 5, request_id="open-1", verify_all_drafts=True).session_id == first.session_id
        error = rpc_error(open_session, stub, [3, 4], 5, request_id="open-1")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "verify_all_drafts" in error.details()
