"""Stopping the server with calls in flight: every call ends OK or UNAVAILABLE, never CANCELLED.
Steps already accepted into the gather window run at once (the window closes on stop) and are
answered; a stream ends UNAVAILABLE once its accepted steps are answered; what is still unanswered
when the grace period runs out (a step queued behind a running engine step, the running step
itself, an OpenSession still admitting) gets UNAVAILABLE from the service before gRPC would cut
it. The states are reached through controlled gates (a gather window of ten minutes, an engine
whose steps wait for the test), not timing luck."""

import queue
import threading
import time

import grpc

from verifier import rpc
from verifier.server.testing import LoopbackServer

from .helpers import code_of, open_session, step
from .test_service_cancel import GatedEngine, _in_thread, _queued, _wait_until

FOREVER_MS = 600_000.0  # a gather window no test waits out
GRACE_S = 10.0


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
    for _ in range(3):  # the same states every time: the gates hold them, not the clock
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
