"""Cancellation, deadlines and batching, made deterministic with an engine whose steps wait at a
gate: a step handed to the engine completes and its result is stored for a retry; a step still
queued when its caller leaves is withdrawn and changes nothing; steps that queue while the engine
is busy run together as one engine batch."""

import threading
import time

import grpc
import pytest

from verifier import rpc
from verifier.engine import Engine
from verifier.server.testing import LoopbackServer

from .helpers import code_of, open_session, rpc_error, step, verify_one


class GatedEngine(Engine):
    """An engine whose open and step wait until `gate` is set; `entered` says one has started."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def _wait(self):
        self.entered.set()
        assert self.gate.wait(20), "the test never opened the gate"

    def opening(self, *args, **kwargs):
        self._wait()
        return super().opening(*args, **kwargs)

    def step(self, requests):
        self._wait()
        return super().step(requests)


@pytest.fixture(scope="module")
def gated(text_checkpoint):
    with LoopbackServer(text_checkpoint, n_slots=6, max_seq_len=96, engine_class=GatedEngine) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield server, server.engine, rpc.VerifierStub(channel)
        server.engine.gate.set()


@pytest.fixture
def closed_gate(gated):
    _, engine, _ = gated
    engine.gate.clear()
    engine.entered.clear()
    yield engine
    engine.gate.set()


def _in_thread(fn, *args, **kwargs):
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except grpc.RpcError as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _queued(server) -> int:
    return server.run_on_loop(lambda: len(server.server.service.scheduler._queue))


def _wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_deadline_after_hand_off_keeps_the_result_for_a_retry(gated, closed_gate, plain):
    server, engine, stub = gated
    expected = plain([7, 7, 7], 20)
    closed_gate.gate.set()
    opened = open_session(stub, [7, 7, 7], 20)
    closed_gate.gate.clear()
    closed_gate.entered.clear()
    request = rpc.VerifyRequest(steps=[step(opened.session_id, opened.position, expected.tokens[1:3], request_id="r1")])
    thread, out = _in_thread(stub.Verify, request, timeout=0.5)
    assert engine.entered.wait(10)  # handed to the engine, then the caller's deadline passes
    thread.join()
    assert out["error"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    engine.gate.set()
    (retry,) = stub.Verify(request).results
    assert retry.status.code == 0 and list(retry.tokens) == expected.tokens[1:4]
    assert retry.position == opened.position + 3  # advanced once
    stale = verify_one(stub, opened.session_id, opened.position, request_id="r2")
    assert code_of(stale) == grpc.StatusCode.ABORTED and stale.status.current_position == retry.position
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


@pytest.mark.parametrize("via", ["Verify", "VerifyRounds"])
def test_step_withdrawn_while_queued_changes_nothing(gated, closed_gate, plain, via):
    server, engine, stub = gated
    engine.gate.set()
    a, b = open_session(stub, [1, 2], 20), open_session(stub, [3, 4], 20)
    engine.gate.clear()
    engine.entered.clear()
    busy, busy_out = _in_thread(verify_one, stub, a.session_id, a.position)  # holds the engine
    assert engine.entered.wait(10)
    request = rpc.VerifyRequest(steps=[step(b.session_id, b.position, [5], request_id="b1")])
    if via == "Verify":
        error = rpc_error(stub.Verify, request, timeout=0.3)
    else:  # the stream's caller goes away with its request queued
        error = rpc_error(lambda: list(stub.VerifyRounds(iter([request]), timeout=0.3)))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until(lambda: _queued(server) == 0)  # the queued step left with its caller
    engine.gate.set()
    busy.join()
    assert busy_out["value"].status.code == 0
    # b never moved: a step from its original position runs and matches plain decoding
    result = verify_one(stub, b.session_id, b.position, request_id="b1")
    assert result.status.code == 0 and list(result.tokens) == plain([3, 4], 20).tokens[1:2]
    for s in (a, b):
        stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))


def test_steps_waiting_on_a_busy_engine_share_one_batch(gated, closed_gate, plain):
    """While the engine holds one step, three sessions' steps and two back-to-back steps of a
    fourth session (on one stream) queue: the three and the fourth's first run as one batch, the
    fourth's second waits for the next (a session appears once per batch)."""
    server, engine, stub = gated
    engine.gate.set()
    prompts = [[10 + i, 20 + i] for i in range(5)]
    sessions = [open_session(stub, p, 20) for p in prompts]
    before = stub.GetStats(rpc.GetStatsRequest())
    engine.gate.clear()
    engine.entered.clear()
    held, _ = _in_thread(verify_one, stub, sessions[0].session_id, sessions[0].position)
    assert engine.entered.wait(10)
    threads = [_in_thread(verify_one, stub, s.session_id, s.position, [1, 2]) for s in sessions[1:4]]
    last = sessions[4]
    stream = [step(last.session_id, last.position), step(last.session_id, last.position + 1)]
    threads.append(_in_thread(lambda: list(stub.VerifyStream(iter(stream)))))
    _wait_until(lambda: _queued(server) == 5)
    engine.gate.set()
    held.join()
    for thread, _ in threads:
        thread.join()
    *singles, streamed = [out["value"] for _, out in threads]
    after = stub.GetStats(rpc.GetStatsRequest())
    assert after.engine_steps - before.engine_steps == 3
    assert after.rows_per_batch.sum - before.rows_per_batch.sum == 1 + 3 * 3 + 1 + 1
    for s, prompt, result in zip(sessions[1:4], prompts[1:4], singles):
        assert result.status.code == 0
        assert [s.first_token, *result.tokens] == plain(prompt, 20).tokens[: 1 + len(result.tokens)]
    assert [r.status.code for r in streamed] == [0, 0]
    assert [last.first_token, *streamed[0].tokens, *streamed[1].tokens] == plain(prompts[4], 20).tokens[:3]
    for s in sessions:
        stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id))


def test_cancelled_open_session(gated, closed_gate):
    server, engine, stub = gated
    free = stub.GetStats(rpc.GetStatsRequest()).free_slots
    # with a request id: the session is kept, and a retry gets it
    request = rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=5, request_id="open-r1")
    assert rpc_error(stub.OpenSession, request, timeout=0.3).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # without one: no one could name the session, so it is closed once admitted
    orphan = rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=5)
    assert rpc_error(stub.OpenSession, orphan, timeout=0.3).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    engine.gate.set()
    retried = stub.OpenSession(request)
    again = stub.OpenSession(request)
    assert retried.session_id == again.session_id and retried.position == 3
    _wait_until(lambda: stub.GetStats(rpc.GetStatsRequest()).free_slots == free - 1)
    assert stub.GetStats(rpc.GetStatsRequest()).open_sessions == 1
    stub.CloseSession(rpc.CloseSessionRequest(session_id=retried.session_id))
    assert stub.GetStats(rpc.GetStatsRequest()).free_slots == free


def test_close_with_steps_in_flight(gated, closed_gate, plain):
    """Closing a session whose step the engine runs: that step completes and is answered. Closing
    one whose step still queues: that step gets NOT_FOUND (position 0: the server holds no such
    session). Both slots come back."""
    server, engine, stub = gated
    engine.gate.set()
    free = stub.GetStats(rpc.GetStatsRequest()).free_slots
    running, queued = open_session(stub, [5, 6, 7], 20), open_session(stub, [8, 9], 20)
    engine.gate.clear()
    engine.entered.clear()
    run_thread, run_out = _in_thread(verify_one, stub, running.session_id, running.position, [1, 2])
    assert engine.entered.wait(10)
    queue_thread, queue_out = _in_thread(verify_one, stub, queued.session_id, queued.position)
    _wait_until(lambda: _queued(server) == 1)
    for s in (running, queued):
        assert stub.CloseSession(rpc.CloseSessionRequest(session_id=s.session_id)).closed
    engine.gate.set()
    run_thread.join()
    queue_thread.join()
    ran, refused = run_out["value"], queue_out["value"]
    assert ran.status.code == 0 and [running.first_token, *ran.tokens] == plain([5, 6, 7], 20).tokens[: 1 + len(ran.tokens)]
    assert code_of(refused) == grpc.StatusCode.NOT_FOUND and "closed" in refused.status.message and refused.position == 0
    _wait_until(lambda: stub.GetStats(rpc.GetStatsRequest()).free_slots == free)


def test_request_id_reused_while_its_step_runs(gated, closed_gate, plain):
    """While step "x1" runs, "x1" with other drafts is INVALID_ARGUMENT at once; "x1" with the same
    content joins the running step and gets its result."""
    server, engine, stub = gated
    engine.gate.set()
    opened = open_session(stub, [4, 4, 2], 20)
    expected = plain([4, 4, 2], 20)
    engine.gate.clear()
    engine.entered.clear()
    first, first_out = _in_thread(verify_one, stub, opened.session_id, opened.position, expected.tokens[1:3], request_id="x1")
    assert engine.entered.wait(10)
    other = verify_one(stub, opened.session_id, opened.position, expected.tokens[1:2], request_id="x1")
    assert code_of(other) == grpc.StatusCode.INVALID_ARGUMENT and "'x1'" in other.status.message
    joined, joined_out = _in_thread(verify_one, stub, opened.session_id, opened.position, expected.tokens[1:3], request_id="x1")
    engine.gate.set()
    first.join()
    joined.join()
    assert first_out["value"].status.code == 0 and list(first_out["value"].tokens) == expected.tokens[1:4]
    assert joined_out["value"].SerializeToString() == first_out["value"].SerializeToString()
    stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))


def test_open_abandoned_by_its_deadline_is_reaped(text_checkpoint):
    """An OpenSession with a request id whose caller's deadline passed keeps its session for a retry,
    but not forever: the idle timeout gives its slot back."""
    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=64, idle_timeout_s=0.5, engine_class=GatedEngine) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            server.engine.gate.clear()
            request = rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=5, request_id="abandoned")
            assert rpc_error(stub.OpenSession, request, timeout=0.3).code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert stub.GetStats(rpc.GetStatsRequest()).free_slots == 1  # held while it is admitted
            server.engine.gate.set()
            _wait_until(lambda: stub.GetStats(rpc.GetStatsRequest()).free_slots == 2, timeout=10)
            assert stub.GetStats(rpc.GetStatsRequest()).open_sessions == 0


def test_an_open_request_id_names_one_session_under_every_timing(gated, closed_gate):
    """AIP-155 for OpenSession, each timing driven by the gate, 50 times: the first call gives up
    while its open is inside the engine; a retry arrives while it still is; another after it was
    admitted; one more after the session was closed (a duplicate delivered late). All four name
    one session; the late one opens nothing; the slots come back."""
    server, engine, stub = gated
    engine.gate.set()
    stats = lambda: stub.GetStats(rpc.GetStatsRequest())  # noqa: E731
    free = stats().free_slots
    for run in range(50):
        engine.gate.clear()
        engine.entered.clear()
        request = rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=5, request_id=f"one-open-{run}")
        assert rpc_error(stub.OpenSession, request, timeout=0.1).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert engine.entered.wait(10)  # the abandoned open is inside the engine, held at the gate
        retry, out = _in_thread(stub.OpenSession, request)
        _wait_until(lambda: server.run_on_loop(lambda: len(server.server.service._admission_waits)) == 1)
        engine.gate.set()
        retry.join(30)
        first = out["value"]
        assert stub.OpenSession(request).session_id == first.session_id, f"run {run}"
        assert (stats().open_sessions, stats().free_slots) == (1, free - 1), f"run {run}"
        assert stub.CloseSession(rpc.CloseSessionRequest(session_id=first.session_id)).closed
        late = stub.OpenSession(request)
        assert late.session_id == first.session_id, f"run {run}: a late duplicate opened a second session"
        assert (stats().open_sessions, stats().free_slots) == (0, free), f"run {run}"
