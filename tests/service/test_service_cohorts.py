"""Cohorts (`verifier serve --cohorts N`): the sessions split into N groups whose batches take turns
on the engine, so one group's results travel while another's step runs. Sessions in lockstep then
run one batch per cohort per round, each batch waiting only for its own cohort; a lone session never
waits for a cohort with nothing queued; and every stream is the one a single cohort gives, token for
token (a row's bits do not depend on its batch). The window is long (seconds), so a wait shows
plainly in the wall time and the counts are exact."""

import threading
import time

import grpc
import pytest

from verifier import rpc
from verifier.server.config import ServerConfig
from verifier.server.testing import LoopbackServer

from .helpers import open_session, step

WINDOW_S = 1.5
PROMPTS = [[5 + i, 6, 7, 8 + 2 * i] for i in range(4)]


def _run_lockstep(stub, prompts, rounds):
    """Each session on its own thread, `rounds` plain steps one after the other, after one Verify
    call holding every session's first step. -> (tokens of each session, seconds the threads took)."""
    sessions = [open_session(stub, p, 40) for p in prompts]
    first = stub.Verify(rpc.VerifyRequest(steps=[step(s.session_id, s.position) for s in sessions]))
    tokens = {r.session_id: list(r.tokens) for r in first.results}
    positions = {r.session_id: r.position for r in first.results}
    assert all(r.status.code == 0 for r in first.results)

    def run(session):
        position = positions[session.session_id]
        for _ in range(rounds - 1):
            (result,) = stub.Verify(rpc.VerifyRequest(steps=[step(session.session_id, position)])).results
            assert result.status.code == 0, result.status.message
            tokens[session.session_id] += result.tokens
            position = result.position

    threads = [threading.Thread(target=run, args=(s,)) for s in sessions]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    for s in sessions:
        stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))
    return [tokens[s.session_id] for s in sessions], elapsed


def _stats(stub):
    return stub.GetStats(rpc.GetStatsRequest())


@pytest.fixture(scope="module")
def plain_streams(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=6, max_seq_len=96, max_wait_ms=WINDOW_S * 1000) as server:
        with grpc.insecure_channel(server.address) as channel:
            return _run_lockstep(rpc.VerifierStub(channel), PROMPTS, rounds=6)[0]


@pytest.fixture(scope="module")
def in_cohorts(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=6, max_seq_len=96, max_wait_ms=WINDOW_S * 1000, cohorts=2) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield server, rpc.VerifierStub(channel)


def test_each_round_runs_one_batch_per_cohort_with_the_same_streams(in_cohorts, plain_streams):
    server, stub = in_cohorts
    before = _stats(stub)
    streams, elapsed = _run_lockstep(stub, PROMPTS, rounds=6)
    after = _stats(stub)
    assert after.steps - before.steps == 4 * 6
    assert after.engine_steps - before.engine_steps == 2 * 6  # two cohorts of two: a batch each per round, no fragment
    assert elapsed < WINDOW_S  # every batch ran as soon as its own cohort's steps were in
    assert streams == plain_streams  # token for token what one batch for all gives
    scheduler = server.server.service.scheduler
    assert sorted(len(m) for m in scheduler._members) == [0, 0]  # closed sessions leave their cohorts


def test_a_lone_session_never_waits_for_an_empty_cohort(in_cohorts):
    _, stub = in_cohorts
    before = _stats(stub)
    (tokens,), elapsed = _run_lockstep(stub, [[3, 1, 4]], rounds=5)
    assert _stats(stub).engine_steps - before.engine_steps == 5
    assert elapsed < WINDOW_S and len(tokens) == 5


def test_cohorts_must_be_at_least_one(tmp_path):
    with pytest.raises(ValueError, match="cohorts must be at least 1"):
        ServerConfig(model_dir=tmp_path, port=0, cohorts=0)
