"""Server-side drafters (OpenSessionRequest.server_drafter): a session whose drafts the server
proposes, with the checkpoint's MTP head or the n-gram proposer. Its steps carry no draft_ids; its
stream equals plain decoding bitwise (greedy and seeded sampling: the MTP drafts of a sampled
session are coupled) and takes the steps the same proposer takes in process (generate), also when
several MTP sessions propose together in one batch; retries get the stored result without a new
proposal; bad requests are refused naming the field; a drafter that fails fails its own step."""

import grpc
import pytest

from verifier import rpc
from verifier.engine import Engine
from verifier.generate import generate
from verifier.model import load_model
from verifier.model.mtp import load_mtp_head
from verifier.params import SamplingParams
from verifier.proposers.mtp import MTPProposer
from verifier.proposers.ngram import NgramProposer
from verifier.server.convert import sampling_params
from verifier.server.principals import ANONYMOUS
from verifier.server.testing import LoopbackServer

from .conftest import NAME
from .helpers import code_of, open_session, rpc_error, step, verify_one

PROMPT = [21, 4, 58, 9, 33, 21, 4, 58]
MAX_SEQ_LEN, MAX_K, K = 96, 6, 3


@pytest.fixture(scope="module")
def mtp_dir(mtp_checkpoint):
    return mtp_checkpoint(NAME)  # the service tests' tiny model (same weights) with a random MTP head


@pytest.fixture(scope="module")
def drafting_stub(mtp_dir):
    with LoopbackServer(mtp_dir, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel), server


@pytest.fixture(scope="module")
def no_mtp_stub(mtp_dir):
    with LoopbackServer(mtp_dir, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, mtp=False) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel)


@pytest.fixture(scope="module")
def in_process(mtp_dir):
    """in_process(drafter, prompt, n, sampling) -> generate() with that proposer at K drafts a step."""
    model = load_model(mtp_dir)
    engine = Engine(model, n_slots=1, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K)
    head = load_mtp_head(mtp_dir, model)

    def run(drafter, prompt, n, sampling=None):
        # coupled MTP drafts for a sampled session, as the server drafts them
        proposer = MTPProposer(head, MAX_SEQ_LEN, sampling or SamplingParams()) if drafter == "mtp" else NgramProposer()
        return generate(engine, list(prompt), n, sampling, proposer=proposer, k=K)

    return run


def _decode(stub, sid, position, first, n, **fields):
    """Steps without drafts until the session finishes -> (tokens, accepted per step, verified per step)."""
    tokens, accepted, verified = [first], [], []
    while len(tokens) < n:
        result = verify_one(stub, sid, position, **fields)
        assert result.status.code == 0, result.status.message
        tokens += result.tokens
        accepted.append(result.accepted)
        verified.append(result.verified_drafts)
        position = result.position
        if result.finish_reason != rpc.FINISH_NONE:
            break
    return tokens, accepted, verified


def test_model_info_lists_the_server_drafters(drafting_stub, no_mtp_stub):
    stub, _ = drafting_stub
    assert list(stub.GetModelInfo(rpc.GetModelInfoRequest()).server_drafters) == ["ngram", "mtp"]
    assert list(no_mtp_stub.GetModelInfo(rpc.GetModelInfoRequest()).server_drafters) == ["ngram"]  # --no-mtp


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_server_drafted_stream_equals_plain_decoding(drafting_stub, plain, in_process, drafter, sampled):
    stub, _ = drafting_stub
    sampling = rpc.Sampling(temperature=0.8, seed=11) if sampled else rpc.Sampling()
    n = 40
    opened = open_session(stub, PROMPT, n, server_drafter=drafter, server_draft_k=K, sampling=sampling)
    tokens, accepted, verified = _decode(stub, opened.session_id, opened.position, opened.first_token, n)
    params = sampling_params(sampling)
    assert tokens == plain(PROMPT, n, params if sampled else None).tokens  # bitwise: the same ids
    # the same steps the proposer takes in process (the loopback server verifies every draft)
    local = in_process(drafter, PROMPT, n, params)
    assert tokens == local.tokens
    assert accepted == local.accepted_per_step and verified == local.drafted_per_step
    assert sum(verified) > 0  # the server did draft
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_server_drafted_steps_over_a_stream(drafting_stub, plain):
    stub, _ = drafting_stub
    n = 30
    opened = open_session(stub, PROMPT, n, server_drafter="mtp")  # server_draft_k 0: max_k
    sid, position, tokens = opened.session_id, opened.position, [opened.first_token]

    # one step per stream call keeps the position known; the stream answers as Verify does
    while len(tokens) < n:
        (result,) = list(stub.VerifyStream(iter([step(sid, position)])))
        assert result.status.code == 0, result.status.message
        assert result.verified_drafts <= MAX_K
        tokens += result.tokens
        position = result.position
        if result.finish_reason != rpc.FINISH_NONE:
            break
    assert tokens == plain(PROMPT, n).tokens
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


def test_a_step_with_draft_ids_is_invalid_argument_and_changes_nothing(drafting_stub, plain):
    stub, _ = drafting_stub
    expected = plain(PROMPT, 20).tokens
    opened = open_session(stub, PROMPT, 20, server_drafter="ngram", server_draft_k=2)
    sid, p = opened.session_id, opened.position
    refused = verify_one(stub, sid, p, expected[1:3])
    assert code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT and "draft_ids" in refused.status.message
    assert refused.position == p and not refused.tokens
    tokens, _, _ = _decode(stub, sid, p, opened.first_token, 20)
    assert tokens == expected
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


class Proposals:
    """The server's MTPDrafter.propose wrapped (an instance attribute, set on the server's loop):
    the asks of each batched proposal, as (slot, context length, k) per ask, and what came back."""

    def __init__(self, server):
        self.server, self.calls = server, []

    def __enter__(self):
        mtp = self.server.server.mtp
        propose = mtp.propose

        def recording(asks):
            results = propose(asks)
            self.calls.append(([(a.track.slot, len(a.context), a.k) for a in asks], results))
            return results

        self.server.run_on_loop(setattr, mtp, "propose", recording)
        return self

    def __exit__(self, *exc):
        self.server.run_on_loop(delattr, self.server.server.mtp, "propose")  # the class's again

    def asked_by(self, slot: int) -> int:
        return sum(1 for asks, _ in self.calls for ask in asks if ask[0] == slot)


def _slot(server, sid) -> int:
    return server.run_on_loop(lambda: server.server.service.sessions.find(sid, ANONYMOUS).sequence.slot)


def _settled(server) -> None:
    """Every job queued on the server's worker has run (a proposal made ahead runs after its step is answered)."""
    server.server.service.worker.submit(lambda: None).result(timeout=30)


def test_a_retried_step_gets_the_stored_result_without_a_new_proposal(drafting_stub, plain):
    stub, server = drafting_stub
    expected = plain(PROMPT, 20).tokens
    opened = open_session(stub, PROMPT, 20, server_drafter="mtp", server_draft_k=K)
    sid, p = opened.session_id, opened.position
    slot = _slot(server, sid)
    with Proposals(server) as proposals:
        first = verify_one(stub, sid, p, request_id="s1")
        _settled(server)
        # its own drafts, and the next step's, proposed on the worker once the step had run
        assert first.status.code == 0 and proposals.asked_by(slot) == 2
        again = verify_one(stub, sid, p, request_id="s1")
        _settled(server)
        assert again.SerializeToString() == first.SerializeToString() and proposals.asked_by(slot) == 2
    other = verify_one(stub, sid, p, request_id="s1", return_logits=True)  # the same id, other content
    assert code_of(other) == grpc.StatusCode.INVALID_ARGUMENT and "'s1'" in other.status.message
    tokens, _, _ = _decode(stub, sid, first.position, opened.first_token, 20)
    assert [opened.first_token] + list(first.tokens) + tokens[1:] == expected
    stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


SESSION_SAMPLINGS = [rpc.Sampling(), rpc.Sampling(temperature=0.9, top_k=20, seed=4),
                     rpc.Sampling(temperature=1.3, top_p=0.9, seed=8)]
SESSION_PROMPTS = [PROMPT, [7, 3, 60, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def test_mtp_sessions_propose_together_and_stream_as_alone(drafting_stub, plain, in_process):
    """Three MTP sessions (greedy, top-k and top-p sampling; other prompts, so other positions)
    stepping in one Verify call a round: their drafts are proposed in one batched proposal, each
    stream equals plain decoding, and each takes the steps (accepted and verified per step) the
    session takes alone in process: its drafts do not depend on what shares the batch."""
    stub, server = drafting_stub
    n = 24
    opened = [open_session(stub, prompt, n, server_drafter="mtp", server_draft_k=K, sampling=sampling)
              for prompt, sampling in zip(SESSION_PROMPTS, SESSION_SAMPLINGS)]
    sids = [o.session_id for o in opened]
    positions = [o.position for o in opened]
    tokens = [[o.first_token] for o in opened]
    accepted, verified = [[] for _ in opened], [[] for _ in opened]
    going = set(range(len(opened)))
    with Proposals(server) as proposals:
        while going:
            live = sorted(going)
            results = stub.Verify(rpc.VerifyRequest(steps=[step(sids[i], positions[i]) for i in live])).results
            for i, result in zip(live, results):
                assert result.status.code == 0, result.status.message
                tokens[i] += result.tokens
                accepted[i].append(result.accepted)
                verified[i].append(result.verified_drafts)
                positions[i] = result.position
                if result.finish_reason != rpc.FINISH_NONE:
                    going.discard(i)
    assert max(len(asks) for asks, _ in proposals.calls) == len(opened), "the sessions proposed together"
    assert all(not isinstance(r, Exception) for _, results in proposals.calls for r in results)
    for i, (prompt, sampling) in enumerate(zip(SESSION_PROMPTS, SESSION_SAMPLINGS)):
        params = sampling_params(sampling) if sampling.temperature else None
        assert tokens[i] == plain(prompt, n, params).tokens, f"session {i}: the plain stream"
        local = in_process("mtp", prompt, n, params)
        assert accepted[i] == local.accepted_per_step and verified[i] == local.drafted_per_step, f"session {i}"
    assert sum(map(sum, accepted)) > 0
    for sid in sids:
        stub.CloseSession(rpc.CloseSessionRequest(session_id=sid))


def test_a_stale_step_is_aborted_and_proposes_nothing(drafting_stub):
    stub, _ = drafting_stub
    opened = open_session(stub, PROMPT, 20, server_drafter="mtp", server_draft_k=K)
    stale = verify_one(stub, opened.session_id, opened.position + 1)
    assert code_of(stale) == grpc.StatusCode.ABORTED and stale.position == opened.position
    ok = verify_one(stub, opened.session_id, opened.position)
    assert ok.status.code == 0
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


@pytest.mark.parametrize("fields, named", [
    (dict(server_drafter="eagle"), "server_drafter"),  # not a drafter of this server
    (dict(server_drafter="ngram", server_draft_k=MAX_K + 1), "server_draft_k"),  # past max_k
    (dict(server_draft_k=2), "server_draft_k"),  # a k without a drafter
])
def test_bad_open_requests_are_invalid_argument(drafting_stub, fields, named):
    stub, _ = drafting_stub
    free = stub.GetStats(rpc.GetStatsRequest()).free_slots
    error = rpc_error(open_session, stub, PROMPT, 5, **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and named in error.details(), error.details()
    assert stub.GetStats(rpc.GetStatsRequest()).free_slots == free  # nothing admitted


def test_mtp_without_a_loaded_head_is_invalid_argument(no_mtp_stub):
    error = rpc_error(open_session, no_mtp_stub, PROMPT, 5, server_drafter="mtp")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "server_drafter" in error.details(), error.details()


def test_open_retry_with_another_drafter_is_invalid_argument(drafting_stub):
    stub, _ = drafting_stub
    first = open_session(stub, PROMPT, 5, request_id="open-drafter", server_drafter="ngram")
    error = rpc_error(open_session, stub, PROMPT, 5, request_id="open-drafter", server_drafter="mtp")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'open-drafter'" in error.details()
    again = open_session(stub, PROMPT, 5, request_id="open-drafter", server_drafter="ngram")
    assert again.session_id == first.session_id
    stub.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id))


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_server_drafts_are_trimmed_like_any_drafts_and_the_stream_is_unchanged(mtp_dir, plain, drafter):
    """With goodput-aware K on, the policy may trim server drafts as any drafts: the stream is the
    plain one and each step verifies at most the drafts proposed."""
    n = 30
    with LoopbackServer(mtp_dir, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K, goodput=True) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            assert stub.GetModelInfo(rpc.GetModelInfoRequest()).trims_drafts
            opened = open_session(stub, PROMPT, n, server_drafter=drafter, server_draft_k=K)
            tokens, accepted, verified = _decode(stub, opened.session_id, opened.position, opened.first_token, n)
            assert all(a <= v <= K for a, v in zip(accepted, verified))
            stats = stub.GetStats(rpc.GetStatsRequest())
    assert tokens == plain(PROMPT, n).tokens
    assert stats.draft_tokens == sum(verified)


def test_a_failing_proposer_fails_its_own_step_alone(drafting_stub, plain):
    """propose failing (its hidden rows out of step with its context): that step is INTERNAL at the
    unchanged position; an MTP session proposing in the same batch gets its drafts, and a
    client-drafted session is unaffected; observe raising: the session goes on as plain decoding."""
    stub, server = drafting_stub
    expected = plain(PROMPT, 20).tokens
    opened = open_session(stub, PROMPT, 20, server_drafter="mtp", server_draft_k=K)
    mate = open_session(stub, PROMPT, 20, server_drafter="mtp", server_draft_k=K)
    other = open_session(stub, PROMPT, 20)
    sid, p = opened.session_id, opened.position

    def shift_known(by: int):
        server.server.service.sessions.find(sid, ANONYMOUS).drafter.proposer.track.known += by

    server.run_on_loop(shift_known, 1)
    steps = [step(sid, p), step(mate.session_id, mate.position), step(other.session_id, other.position)]
    results = stub.Verify(rpc.VerifyRequest(steps=steps)).results
    assert code_of(results[0]) == grpc.StatusCode.INTERNAL and results[0].position == p
    assert results[1].status.code == 0 and results[1].verified_drafts == K
    assert list(results[1].tokens) == expected[1 : 2 + results[1].accepted]
    assert results[2].status.code == 0 and list(results[2].tokens) == expected[1:2]
    server.run_on_loop(shift_known, -1)

    def break_observe():
        server.server.service.sessions.find(sid, ANONYMOUS).drafter.proposer.observe = lambda hidden: 1 / 0

    first = verify_one(stub, sid, p)
    assert first.status.code == 0
    server.run_on_loop(break_observe)
    tokens, _, verified = _decode(stub, sid, first.position, opened.first_token, 20)
    assert [opened.first_token] + list(first.tokens) + tokens[1:] == expected
    assert verified[1:] == [0] * (len(verified) - 1)  # drafting stopped after the failed observe
    for s in (sid, mate.session_id, other.session_id):
        stub.CloseSession(rpc.CloseSessionRequest(session_id=s))


def test_a_failing_head_forward_fails_its_own_session_alone(drafting_stub, plain):
    """A batched head forward that raises for one session's rows: the proposal is retried for each
    session alone, so only that session's step is INTERNAL; the other MTP session gets its drafts,
    and both streams go on as the plain one."""
    stub, server = drafting_stub
    expected = plain(PROMPT, 20).tokens
    broken, mate = (open_session(stub, PROMPT, 20, server_drafter="mtp", server_draft_k=K) for _ in range(2))
    bad_slot = _slot(server, broken.session_id)
    head = server.server.mtp.head
    forward = head.forward

    def failing(tokens, hidden, batch, pool, **kwargs):
        if bad_slot in batch.slots:
            raise RuntimeError("the head failed")
        return forward(tokens, hidden, batch, pool, **kwargs)

    server.run_on_loop(setattr, head, "forward", failing)
    try:
        steps = [step(broken.session_id, broken.position), step(mate.session_id, mate.position)]
        results = stub.Verify(rpc.VerifyRequest(steps=steps)).results
    finally:
        server.run_on_loop(delattr, head, "forward")
    assert code_of(results[0]) == grpc.StatusCode.INTERNAL and results[0].position == broken.position
    assert results[1].status.code == 0 and results[1].verified_drafts == K
    mate_tokens, _, _ = _decode(stub, mate.session_id, results[1].position, mate.first_token, 20)
    assert [mate.first_token] + list(results[1].tokens) + mate_tokens[1:] == expected
    tokens, _, verified = _decode(stub, broken.session_id, broken.position, broken.first_token, 20)
    assert tokens == expected and sum(verified) > 0  # it drafts again
    for o in (broken, mate):
        stub.CloseSession(rpc.CloseSessionRequest(session_id=o.session_id))
