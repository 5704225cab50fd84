"""Goodput-aware K through the server: each batch verifies only the drafts worth their rows (from
the engine's step costs and each session's acceptance), the result says how many, and the stream
is plain decoding whatever is trimmed. Step costs come from an engine subclass with a fixed table,
so what the policy does is decided by the test, not by this machine's timing."""

import grpc
import pytest
import torch

from drafter.client import VerifierClient
from drafter.loop import generate
from verifier import rpc
from verifier.engine import Engine
from verifier.params import SamplingParams
from verifier.proposers.ngram import NgramProposer
from verifier.proposers.regression import OracleProposer, RandomProposer
from verifier.server.testing import LoopbackServer

from .helpers import open_session, step

VOCAB, MAX_SEQ_LEN, MAX_K = 90, 96, 8


class DearRows(Engine):
    """Every verify row costs a quarter of a one-row step: a draft earns its row only when likely accepted."""

    def step_costs(self):
        return {rows: 1.0 + 0.25 * rows for rows in range(1, 65)}


def _serve(text_checkpoint, **overrides):
    return LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, engine_class=DearRows,
                          goodput=True, **overrides)


def _run(server, proposer, prompt, n, sampling=None, k=4):
    with VerifierClient(server.address, timeout_s=60) as client:
        return generate(client, proposer, prompt_ids=prompt, max_new_tokens=n, sampling=sampling or SamplingParams(),
                        k=k, return_logits=True)


def _stats(server):
    with grpc.insecure_channel(server.address) as channel:
        return rpc.VerifierStub(channel).GetStats(rpc.GetStatsRequest())


def test_always_wrong_drafts_stop_being_verified(text_checkpoint, plain):
    prompt = [4, 8, 15, 16]
    with _serve(text_checkpoint) as server:
        got = _run(server, RandomProposer(VOCAB, seed=1), prompt, 60)
        stats = _stats(server)
    assert got.tokens == plain(prompt, 60).tokens
    drafted = got.drafted_per_step
    assert drafted[0] > 0  # the prior says drafts are worth a try
    late = drafted[len(drafted) // 2 :]
    assert sum(1 for d in late if d > 0) <= len(late) // 4, drafted  # later: an occasional probe at most
    assert stats.draft_tokens == sum(drafted) and stats.trimmed_drafts > sum(drafted)


def test_always_right_drafts_are_all_verified(text_checkpoint, plain):
    prompt = [23, 42, 5]
    expected = plain(prompt, 50)
    with _serve(text_checkpoint) as server:
        got = _run(server, OracleProposer(len(prompt), expected.tokens), prompt, 50)
        stats = _stats(server)
    assert got.tokens == expected.tokens
    # the first step trims one draft (the prior, 0.7, does not pay a fourth row); then all are verified
    assert stats.trimmed_drafts <= 1 and got.accepted_per_step == got.drafted_per_step
    assert stats.draft_tokens == sum(got.drafted_per_step) >= 4 * (got.steps - 2)


@pytest.fixture(scope="module")
def goodput_server(text_checkpoint):
    with _serve(text_checkpoint) as server:
        yield server


@pytest.mark.parametrize("drafts", ["random", "ngram", "oracle"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_streams_with_goodput_equal_plain_decoding(goodput_server, plain, drafts, sampled):
    prompt = [7, 3, 7, 3, 7, 3, 9] if drafts == "ngram" else [11, 12, 13]
    sampling = SamplingParams(temperature=0.8, top_k=30, seed=5) if sampled else None
    expected = plain(prompt, 40, sampling)
    proposer = {"random": RandomProposer(VOCAB, seed=2), "ngram": NgramProposer(),
                "oracle": OracleProposer(len(prompt), expected.tokens)}[drafts]
    got = _run(goodput_server, proposer, prompt, 40, sampling, k=6)
    assert got.tokens == expected.tokens
    assert torch.equal(torch.from_numpy(got.logits), expected.logits)


def test_verified_drafts_on_the_wire(goodput_server, server):
    """With goodput on, accepted <= verified_drafts <= len(draft_ids); off (the shared test server),
    every draft is verified and the result says so."""
    for srv, trimming in ((goodput_server, True), (server, False)):
        with grpc.insecure_channel(srv.address) as channel:
            stub = rpc.VerifierStub(channel)
            opened = open_session(stub, [1, 2, 3], 30)
            position, seen = opened.position, []
            for i in range(12):
                drafts = [(i * 7 + j) % VOCAB for j in range(5)]
                (result,) = stub.Verify(rpc.VerifyRequest(steps=[step(opened.session_id, position, drafts)])).results
                assert result.status.code == 0 and result.HasField("verified_drafts")
                assert result.accepted <= result.verified_drafts <= len(drafts)
                seen.append(result.verified_drafts)
                position = result.position
                if result.finish_reason:
                    break
            stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))
        if trimming:
            assert min(seen) < 5, seen
        else:
            assert set(seen) == {5}, seen
