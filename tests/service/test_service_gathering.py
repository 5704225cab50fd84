"""Gathering: when the engine is free, the next batch waits (up to max_wait_ms) for the sessions of
the batch that just ran, so sessions stepping in lockstep share one batch per round; a lone
session never waits, a session that stops stepping costs one window at most, and a closed session
is not waited for at all. The window here is long (seconds) so that the counts are exact and a
wait shows plainly in the wall time."""

import threading
import time

import grpc
import pytest

from verifier import rpc
from verifier.engine import Engine
from verifier.server.testing import LoopbackServer

from .helpers import open_session, step

WINDOW_S = 1.5


@pytest.fixture(scope="module")
def patient(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=6, max_seq_len=96, max_wait_ms=WINDOW_S * 1000) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield rpc.VerifierStub(channel)


def _stats(stub):
    return stub.GetStats(rpc.GetStatsRequest())


def _lockstep(stub, sessions, rounds, stop_after=None):
    """Each session on its own thread: `rounds` steps one after the other (plain decoding), all
    started by one Verify call holding every session's first step. stop_after[i]: session i goes
    silent after that many steps. Returns the seconds the threads took after the first call."""
    positions = {s.session_id: s.position for s in sessions}
    first = stub.Verify(rpc.VerifyRequest(steps=[step(s.session_id, s.position) for s in sessions]))
    for result in first.results:
        assert result.status.code == 0
        positions[result.session_id] = result.position
    stop_after = stop_after or {}

    def run(i, session):
        position = positions[session.session_id]
        for _ in range(stop_after.get(i, rounds) - 1):
            (result,) = stub.Verify(rpc.VerifyRequest(steps=[step(session.session_id, position)])).results
            assert result.status.code == 0, result.status.message
            position = result.position

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(sessions)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started


def _close(stub, sessions):
    for s in sessions:
        stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))


def test_sessions_in_lockstep_share_one_batch_per_round(patient):
    sessions = [open_session(patient, [5 + i, 6, 7], 40) for i in range(4)]
    before = _stats(patient)
    elapsed = _lockstep(patient, sessions, rounds=8)
    after = _stats(patient)
    assert after.steps - before.steps == 4 * 8
    assert after.engine_steps - before.engine_steps == 8  # one batch per round, never a fragment
    assert elapsed < WINDOW_S  # and every batch ran as soon as its last session answered
    _close(patient, sessions)


def test_a_lone_session_is_not_delayed(patient):
    (session,) = sessions = [open_session(patient, [3, 1, 4], 40)]
    before = _stats(patient)
    elapsed = _lockstep(patient, sessions, rounds=6)
    assert _stats(patient).engine_steps - before.engine_steps == 6
    assert elapsed < WINDOW_S  # a wait for anything but its own step would cost a window per step
    _close(patient, sessions)


def test_a_silent_session_costs_one_window_at_most(patient):
    sessions = [open_session(patient, [9 + i, 2], 40) for i in range(3)]
    elapsed = _lockstep(patient, sessions, rounds=6, stop_after={2: 2})  # session 2 stops after 2 steps, open
    assert WINDOW_S * 0.9 <= elapsed < 2 * WINDOW_S  # the batch after its last step waited for it, once
    _close(patient, sessions)


def test_a_closed_session_is_not_waited_for(patient):
    sessions = [open_session(patient, [20 + i, 2], 40) for i in range(2)]
    (result,) = patient.Verify(rpc.VerifyRequest(steps=[step(sessions[0].session_id, sessions[0].position)])).results
    patient.CloseSession(rpc.CloseSessionRequest(session_id=sessions[0].session_id))  # awaited, then closed
    started = time.monotonic()
    (other,) = patient.Verify(rpc.VerifyRequest(steps=[step(sessions[1].session_id, sessions[1].position)])).results
    assert other.status.code == 0 and time.monotonic() - started < WINDOW_S
    _close(patient, sessions[1:])


class SteadyEngine(Engine):
    """Every step takes at least 40 ms (a large model's step, from the drafters' side)."""

    def step(self, requests):
        started = time.monotonic()
        results = super().step(requests)
        time.sleep(max(0.0, 0.04 - (time.monotonic() - started)))
        return results


def test_the_window_grows_to_drafters_slower_than_max_wait(text_checkpoint):
    """Drafters that take 15 ms between a result and their next step, against a 1 ms max_wait_ms
    and 40 ms steps: the first rounds fragment, the window follows the measured round trip (1.5x
    it, at most one step's time), and from then on every round is one batch."""
    with LoopbackServer(text_checkpoint, engine_class=SteadyEngine, n_slots=4, max_seq_len=96, max_wait_ms=1.0) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            sessions = [open_session(stub, [30 + i, 2], 60) for i in range(4)]
            positions = {s.session_id: s.position for s in sessions}
            barrier = threading.Barrier(len(sessions))

            def run(session, rounds):
                position = positions[session.session_id]
                barrier.wait()
                for _ in range(rounds):
                    time.sleep(0.015)  # the drafter's own work before its next step
                    (result,) = stub.Verify(rpc.VerifyRequest(steps=[step(session.session_id, position)])).results
                    assert result.status.code == 0, result.status.message
                    position = result.position
                positions[session.session_id] = position

            def rounds(n):
                threads = [threading.Thread(target=run, args=(s, n)) for s in sessions]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            rounds(12)  # learning: fragments allowed
            window = server.run_on_loop(lambda: server.server.service.scheduler.gather_window_s())
            assert 0.015 < window <= 0.05
            before = _stats(stub)
            rounds(8)
            after = _stats(stub)
            assert after.steps - before.steps == 32
            assert after.engine_steps - before.engine_steps <= 9  # one batch per round (one fragment allowed)
            _close(stub, sessions)


def test_the_window_never_exceeds_a_step(text_checkpoint):
    """Against fast steps, a drafter that takes 60 ms to come back is not waited for longer than a
    step takes (a fragment costs about one step): the window stays near max_wait_ms."""
    with LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=96, max_wait_ms=1.0) as server:
        scheduler = server.server.service.scheduler
        server.run_on_loop(lambda: setattr(scheduler, "_round_trip_s", 0.06))
        server.run_on_loop(lambda: setattr(scheduler, "_last_step_s", 0.004))
        assert server.run_on_loop(scheduler.gather_window_s) == pytest.approx(0.004)
        server.run_on_loop(lambda: setattr(scheduler, "_last_step_s", 0.0))
        assert server.run_on_loop(scheduler.gather_window_s) == pytest.approx(0.001)


def test_a_call_cut_by_max_batch_rows_runs_its_rest_at_once(text_checkpoint):
    """One Verify call whose steps need more rows than max_batch_rows runs in two batches; its
    sessions cannot step again before the call answers, so the second batch waits for nothing
    (before, it waited a whole gather window for them)."""
    with LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=96, max_wait_ms=WINDOW_S * 1000, max_batch_rows=6,
                        max_k=2) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            sessions = [open_session(stub, [40 + i, 2], 20) for i in range(3)]
            before = _stats(stub)
            started = time.monotonic()
            response = stub.Verify(rpc.VerifyRequest(steps=[step(s.session_id, s.position, [3, 4]) for s in sessions]))
            elapsed = time.monotonic() - started
            assert all(r.status.code == 0 for r in response.results)
            assert _stats(stub).engine_steps - before.engine_steps == 2  # 9 rows: 6, then 3 (fewer than a batch holds)
            assert elapsed < WINDOW_S
            _close(stub, sessions)
