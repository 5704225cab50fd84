"""Gathering with a row cap that trimming makes room under: with goodput on, a batch holds every
session whose step the policy may trim to one row (max_batch_rows counts the rows the batch can
run, not the drafts sent), and the rows the policy keeps decide what runs; without trimming, the
drafts as sent fill the cap. A round of lockstep sessions whose drafts are worth no row is one
batch, not a split by the drafts they sent.

No timing decides a count here: the engine is held (a gate) while the steps queue, the test sees
them queued on the server's own loop, and the window is a minute long, so a batch starts when its
sessions have come or its rows fill, never when a clock says so."""

import threading
import time

import grpc
import pytest

from verifier import rpc
from verifier.engine import Engine
from verifier.server.testing import LoopbackServer

from .helpers import open_session, step

CALLS, SESSIONS_PER_CALL, K = 4, 2, 4  # 8 sessions x 5 rows sent = 40 rows
MAX_BATCH_ROWS = 20  # the rows sent fill two batches; one row each (trimmed) fits one
PATIENT_MS = 60_000.0


class HeldRows(Engine):
    """A row costs what a step of one row costs (drafts pay only when always accepted), and while
    `held` is clear a step waits for it."""

    held = threading.Event()

    def step_costs(self):
        return {rows: float(rows) for rows in range(1, 65)}

    def step(self, requests):
        assert HeldRows.held.wait(60), "the test never released the engine"
        return super().step(requests)


@pytest.fixture()
def gated(text_checkpoint):
    HeldRows.held.set()
    with LoopbackServer(text_checkpoint, n_slots=CALLS * SESSIONS_PER_CALL + 1, max_seq_len=96, max_k=K,
                        max_batch_rows=MAX_BATCH_ROWS, max_wait_ms=PATIENT_MS, goodput=True,
                        engine_class=HeldRows) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield server, rpc.VerifierStub(channel)
    HeldRows.held.set()


def _queued(server) -> int:
    return server.run_on_loop(lambda: len(server.server.service.scheduler._queue))


def _wait_queued(server, n: int) -> None:
    """Until the scheduler's queue holds n steps (the steps' arrival, not a batch, is awaited)."""
    deadline = time.monotonic() + 30
    while _queued(server) != n:
        assert time.monotonic() < deadline, f"{_queued(server)} steps queued, expected {n}"
        time.sleep(0.01)


def _calls(stub, groups, positions):
    """One Verify call per group of sessions on its own thread, each step with K drafts; the
    threads, and the results they fill in by session id."""
    results = {}

    def call(group):
        response = stub.Verify(rpc.VerifyRequest(steps=[step(s, positions[s], [7] * K) for s in group]))
        for r in response.results:
            results[r.session_id] = r

    return [threading.Thread(target=call, args=(g,)) for g in groups], results


def _round(server, stub, groups, positions, hold_first: bool) -> dict:
    """The calls of one round, started one after another, each once the previous one's steps are
    queued; with hold_first, the engine is held until all of them are queued."""
    threads, results = _calls(stub, groups, positions)
    queued = _queued(server)
    for thread, group in zip(threads, groups):
        thread.start()
        queued += len(group)
        if hold_first or thread is not threads[-1]:
            _wait_queued(server, queued)
    HeldRows.held.set()
    for thread in threads:
        thread.join(60)
    assert len(results) == sum(map(len, groups))
    for r in results.values():
        assert r.status.code == 0, r.status.message
        positions[r.session_id] = r.position
    return results


def _engine_steps(stub) -> int:
    return stub.GetStats(rpc.GetStatsRequest()).engine_steps


def test_sessions_whose_drafts_are_trimmed_share_one_batch(gated):
    server, stub = gated
    sessions = [open_session(stub, [10 + i, 3, 5], 40) for i in range(CALLS * SESSIONS_PER_CALL)]
    positions = {s.session_id: s.position for s in sessions}
    groups = [[s.session_id for s in sessions[i::CALLS]] for i in range(CALLS)]
    # a lone session's step holds the engine while every call of the first round queues
    blocker = open_session(stub, [2, 2, 2], 2)  # finished by its step: no later batch waits for it
    HeldRows.held.clear()
    holding = threading.Thread(target=stub.Verify, args=(rpc.VerifyRequest(steps=[step(blocker.session_id,
                                                                                        blocker.position)]),))
    holding.start()
    deadline = time.monotonic() + 30
    while server.run_on_loop(lambda: len(server.server.service.scheduler._running)) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = _engine_steps(stub)
    first = _round(server, stub, groups, positions, hold_first=True)
    holding.join(60)
    assert _engine_steps(stub) - before == 2  # the blocker's step, then the whole round in one batch
    assert all(r.verified_drafts == 0 for r in first.values())  # trimmed: 8 rows of the 20
    # the next round comes call by call: its sent rows pass the cap after the third call, yet the
    # batch waits for the fourth (each session of the last batch is awaited), then runs them all
    before = _engine_steps(stub)
    _round(server, stub, groups, positions, hold_first=False)
    assert _engine_steps(stub) - before == 1


class FreeRows(Engine):
    """Every step costs the same whatever its rows: the policy verifies every draft."""

    def step_costs(self):
        return {rows: 1.0 for rows in range(1, 65)}


def _one_call(text_checkpoint, engine_class, goodput: bool):
    """Every session's step with K drafts in one Verify call: its results, the GetStats before and
    after, and the steps still queued after it."""
    with LoopbackServer(text_checkpoint, n_slots=CALLS * SESSIONS_PER_CALL, max_seq_len=96, max_k=K,
                        max_batch_rows=MAX_BATCH_ROWS, max_wait_ms=PATIENT_MS, goodput=goodput,
                        engine_class=engine_class) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            sessions = [open_session(stub, [10 + i, 3, 5], 40) for i in range(CALLS * SESSIONS_PER_CALL)]
            before = stub.GetStats(rpc.GetStatsRequest())
            response = stub.Verify(rpc.VerifyRequest(steps=[step(s.session_id, s.position, [7] * K) for s in sessions]))
            assert [r.session_id for r in response.results] == [s.session_id for s in sessions]
            return response.results, before, stub.GetStats(rpc.GetStatsRequest()), _queued(server)


def test_without_trimming_the_drafts_sent_fill_the_cap(text_checkpoint):
    """--no-goodput: every draft is verified, so the rows sent are the rows run: 8 sessions of 5
    rows under a cap of 20 run as two batches of 4 sessions."""
    HeldRows.held.set()
    results, before, after, _ = _one_call(text_checkpoint, HeldRows, goodput=False)
    assert all(r.status.code == 0 and r.verified_drafts == K for r in results)
    assert after.engine_steps - before.engine_steps == 2


def test_drafts_the_policy_keeps_past_the_cap_run_in_the_next_batch(text_checkpoint):
    """Taken at one row each, 8 sessions fit the cap; the policy keeps all 5 rows of each (they are
    free), so the first 4 run and the other 4 go back to the queue, run next, unchanged."""
    results, before, after, queued = _one_call(text_checkpoint, FreeRows, goodput=True)
    assert all(r.status.code == 0 and r.verified_drafts == K for r in results)
    assert after.engine_steps - before.engine_steps == 2
    assert after.rows - before.rows == 8 * (K + 1)  # each step ran once: 20 rows, then 20
    assert queued == 0
