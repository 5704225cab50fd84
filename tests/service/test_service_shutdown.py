"""Stopping the server with calls in flight: every call ends OK or UNAVAILABLE, never CANCELLED.
Steps already accepted into the gather window run at once (the window closes on stop) and are
answered; a stream ends UNAVAILABLE once its accepted steps are answered; what is still unanswered
when the grace period runs out (a step queued behind a running engine step, the running step
itself, an OpenSession still admitting) gets UNAVAILABLE from the service before gRPC would cut
it. The states are reached through controlled gates (a gather window of ten minutes, an engine
whose steps wait for the test), not timing luck."""

import asyncio
import queue
import threading
import time

import grpc

from verifier import rpc
from verifier.server.principals import ANONYMOUS
from verifier.server.testing import LoopbackServer

from .helpers import code_of, open_session, step
from .test_service_cancel import GatedEngine, _in_thread, _queued, _wait_until

FOREVER_MS = 600_000.0  # a gather window no test waits out
GRACE_S = 10.0
RUNS = 50  # each race driven this many times: a flake shows as a failed run, not a lucky pass


class _Stream:
    """A VerifyStream that sends `first`, then holds the stream open (the drafter has more to say)."""

    def __init__(self, stub, first: rpc.VerifyStep):
        self.results, self.code, self._release = [], None, threading.Event()

        def requests():
            yield first
            self._release.wait(60)

        self._call = stub.VerifyStream(requests())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for result in self._call:
                self.results.append(result)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()

    def end(self, timeout=30.0):
        self._thread.join(timeout)
        self._release.set()
        assert not self._thread.is_alive(), "the stream never ended"


def test_stop_runs_the_steps_waiting_in_the_gather_window(text_checkpoint):
    for _ in range(RUNS):  # the same states every time: the gates hold them, not the clock
        server = LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=96, max_k=4, max_wait_ms=FOREVER_MS)
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = rpc.VerifierStub(channel)
                a, b, c = (open_session(stub, [3, 4, 5 + i], 20) for i in range(3))
                # one batch of the three: the next batch waits for all three to come back
                first = stub.Verify(rpc.VerifyRequest(steps=[step(s.session_id, s.position, [7]) for s in (a, b, c)])).results
                assert [r.status.code for r in first] == [0, 0, 0]
                (pa, _, pc) = (r.position for r in first)
                # a's step by Verify and c's on a stream wait in the gather window for b, which never comes
                unary, out = _in_thread(stub.Verify, rpc.VerifyRequest(steps=[step(a.session_id, pa, [7], "a1")]))
                stream = _Stream(stub, step(c.session_id, pc, [7], "c1"))
                _wait_until(lambda: _queued(server) == 2)
                started = time.monotonic()
                server.stop(grace_s=GRACE_S)
                stopped_in = time.monotonic() - started
                unary.join(30)
                stream.end()
            assert "error" not in out, out.get("error")
            (result,) = out["value"].results
            assert result.status.code == 0 and result.position > pa
            assert [r.status.code for r in stream.results] == [0] and stream.results[0].position > pc
            assert stream.code == grpc.StatusCode.UNAVAILABLE  # it takes no more steps: the drafter goes elsewhere
            assert stopped_in < GRACE_S / 2  # the window closed on stop: nothing waited out the grace
        finally:
            server.stop()


def test_what_the_grace_period_leaves_unanswered_gets_unavailable(text_checkpoint):
    server = LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=96, max_k=4, engine_class=GatedEngine)
    engine = server.engine
    stopper = None
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            a, b = (open_session(stub, [3, 4, 5 + i], 20) for i in range(2))
            engine.gate.clear()
            engine.entered.clear()
            running, out_a = _in_thread(stub.Verify, rpc.VerifyRequest(steps=[step(a.session_id, a.position, [7], "a1")]))
            assert engine.entered.wait(20)  # a's step is on the engine, held at the gate
            queued, out_b = _in_thread(stub.Verify, rpc.VerifyRequest(steps=[step(b.session_id, b.position, [7], "b1")]))
            _wait_until(lambda: _queued(server) == 1)
            opening, out_open = _in_thread(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[1, 2], max_new_tokens=4))
            _wait_until(lambda: server.run_on_loop(lambda: len(server.server.service._admission_waits)) == 1)
            done = queue.Queue()
            stopper = threading.Thread(target=lambda: done.put(server.stop(grace_s=0.5)), daemon=True)
            stopper.start()
            for thread in (running, queued, opening):
                thread.join(30)
                assert not thread.is_alive(), "a call outlived the grace period"
        for out in (out_a, out_b):
            assert "error" not in out, out.get("error")
            (result,) = out["value"].results
            assert code_of(result) == grpc.StatusCode.UNAVAILABLE and "grace period" in result.status.message
        assert out_open["error"].code() == grpc.StatusCode.UNAVAILABLE and "grace period" in out_open["error"].details()
    finally:
        engine.gate.set()  # the engine step completes; the stop waits for it
        if stopper is not None:
            stopper.join(60)
        server.stop()


def _servers(checkpoint, **overrides):
    """RUNS fresh loopback servers, one per run -> (run, server, stub); each stopped after its run."""
    for run in range(RUNS):
        server = LoopbackServer(checkpoint, **overrides)
        try:
            with grpc.insecure_channel(server.address) as channel:
                yield run, server, rpc.VerifierStub(channel)
        finally:
            server.stop()


def _stop_while_the_loop_is_busy(server, busy_s: float, grace_s: float) -> threading.Thread:
    """Begin the server's stop, then hold its event loop for busy_s: calls that arrive meanwhile
    wait in gRPC's core, not yet seen by the service, as calls do on a loaded server when SIGTERM
    comes. -> the thread that holds the loop (join it once the calls are sent)."""

    def begin_then_block():
        asyncio.get_running_loop().create_task(server.server.stop(grace_s=grace_s, drain_s=0.0))
        time.sleep(busy_s)

    holder = threading.Thread(target=server.run_on_loop, args=(begin_then_block,), daemon=True)
    holder.start()
    return holder


def test_calls_unseen_when_the_stop_begins_are_answered_not_cancelled(text_checkpoint):
    """SIGTERM while step calls wait in gRPC's core (the event loop busy): each is run and answered
    OK within the grace period. A server that closed its port then would have them CANCELLED by the
    core (grpc/grpc#41785), and a step handed to a batcher that had already ended would wait out the
    grace period."""
    for run, server, stub in _servers(text_checkpoint, n_slots=3, max_seq_len=64, max_k=2):
        sessions = [open_session(stub, [3, 4, 5 + i], 8) for i in range(3)]
        holder = _stop_while_the_loop_is_busy(server, 0.1, GRACE_S)
        calls = [stub.Verify.future(rpc.VerifyRequest(steps=[step(s.session_id, s.position, [7])])) for s in sessions]
        holder.join(30)
        started = time.monotonic()
        results = [call.result(timeout=30).results[0] for call in calls]  # an RpcError (CANCELLED) fails here
        assert [code_of(r) for r in results] == [grpc.StatusCode.OK] * len(sessions), f"run {run}"
        assert time.monotonic() - started < GRACE_S / 2, f"run {run}: a step waited out the grace period"


def _stopping(server) -> bool:
    return server.run_on_loop(lambda: server.server.service.stopping)


def test_stop_while_a_batch_runs_answers_it(text_checkpoint):
    """SIGTERM while the engine runs a batch: the batch completes within the grace period and its
    step is answered OK; the stop then ends without waiting the grace period out."""
    for run, server, stub in _servers(text_checkpoint, n_slots=2, max_seq_len=64, max_k=2, engine_class=GatedEngine):
        engine = server.engine
        a = open_session(stub, [3, 4, 5], 8)
        engine.gate.clear()
        engine.entered.clear()
        stopper = threading.Thread(target=server.stop, kwargs={"grace_s": GRACE_S}, daemon=True)
        try:
            running, out = _in_thread(stub.Verify, rpc.VerifyRequest(steps=[step(a.session_id, a.position, [7])]))
            assert engine.entered.wait(20)  # the batch is on the engine, held at the gate
            started = time.monotonic()
            stopper.start()
            _wait_until(lambda: _stopping(server))
            engine.gate.set()
            running.join(30)
            stopper.join(30)
        finally:
            engine.gate.set()
        assert "error" not in out, f"run {run}: {out.get('error')}"
        (result,) = out["value"].results
        assert code_of(result) == grpc.StatusCode.OK and result.position > a.position, f"run {run}"
        assert not stopper.is_alive() and time.monotonic() - started < GRACE_S / 2, f"run {run}: the stop waited out the grace"


class _Drafter:
    """A VerifyStream drafting as a client does: each step sent once the previous one is answered."""

    def __init__(self, stub, session):
        self.results, self.code, self.trailing = [], None, {}
        self._answered = queue.Queue()
        self._ended = threading.Event()
        self._session_id, self._position = session.session_id, session.position
        self._call = stub.VerifyStream(self._requests())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _requests(self):
        position = self._position
        while not self._ended.is_set():
            yield step(self._session_id, position, [7])
            try:
                position = self._answered.get(timeout=30)
            except queue.Empty:
                return

    def _read(self):
        try:
            for result in self._call:
                self.results.append(result)
                self._answered.put(result.position)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.trailing = exc.code(), dict(exc.trailing_metadata() or ())
        finally:
            self._ended.set()

    def wait_for(self, n: int) -> None:
        _wait_until(lambda: len(self.results) >= n or self._ended.is_set())

    def end(self, timeout=30.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream never ended"


def test_stop_while_streams_step_loses_no_step(text_checkpoint):
    """SIGTERM while drafters step on streams, at a different point of the streams each run: every
    step the server ran was answered (the engine's position is the last answered one), every answer
    is OK, and each stream ends UNAVAILABLE (its drafter resends elsewhere), marked as the server's
    own (trailing verifier-stopping), never CANCELLED."""
    for run, server, stub in _servers(text_checkpoint, n_slots=2, max_seq_len=128, max_k=2):
        opened = [open_session(stub, [3, 4, 5 + i], 60) for i in range(2)]
        sequences = server.run_on_loop(lambda: [server.server.service.sessions.find(s.session_id, ANONYMOUS).sequence for s in opened])
        drafters = [_Drafter(stub, s) for s in opened]
        drafters[0].wait_for(1 + run % 5)
        server.stop(grace_s=GRACE_S)
        for drafter, sequence, session in zip(drafters, sequences, opened):
            drafter.end()
            assert drafter.code == grpc.StatusCode.UNAVAILABLE, f"run {run}: the stream ended {drafter.code}"
            assert drafter.trailing.get(rpc.STOPPING_KEY) == "1", f"run {run}: the server did not say it stops"
            assert all(code_of(r) == grpc.StatusCode.OK for r in drafter.results), f"run {run}"
            answered = drafter.results[-1].position if drafter.results else session.position
            assert sequence.position == answered, f"run {run}: the engine ran a step no one was answered"
