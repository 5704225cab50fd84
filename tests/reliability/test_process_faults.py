"""Faults of whole processes: a reaped session; a drafter process SIGKILLed
with open sessions (the reaper frees its slots); SIGTERM to `python -m verifier serve` with
steps in flight (they finish, health says NOT_SERVING while draining, new calls get UNAVAILABLE)."""

import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier import rpc
from service.helpers import code_of, open_session, rpc_error, verify_one

from .conftest import MAX_K, MAX_SEQ_LEN
from .witness import Witnesses

REPO = Path(__file__).resolve().parents[2]
IDLE_S = 1.0
N_SLOTS = 8


@pytest.fixture(scope="module")
def reaping(reliability_checkpoint):
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(reliability_checkpoint, n_slots=N_SLOTS, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K,
                        idle_timeout_s=IDLE_S) as server:
        with grpc.insecure_channel(server.address) as channel:
            yield server, rpc.VerifierStub(channel)


def _live_ids(server):
    return server.run_on_loop(lambda: {s.id for s in server.server.service.sessions.all()})


def _wait_gone(server, ids, timeout_s):
    deadline = time.monotonic() + timeout_s
    while ids & _live_ids(server):
        assert time.monotonic() < deadline, f"sessions not reaped within {timeout_s} s"
        time.sleep(0.05)


def test_reaped_session(reaping, plain_decode):
    server, stub = reaping
    with Witnesses(stub, plain_decode):  # stepping all along: never idle, never reaped
        idle = open_session(stub, [1, 2, 3], 30)
        _wait_gone(server, {idle.session_id}, IDLE_S + 2.0)
        gone = verify_one(stub, idle.session_id, idle.position)
        assert code_of(gone) == grpc.StatusCode.NOT_FOUND and "reaped" in gone.status.message
        assert not stub.CloseSession(rpc.CloseSessionRequest(session_id=idle.session_id)).closed
    stats = stub.GetStats(rpc.GetStatsRequest())
    assert stats.free_slots == N_SLOTS and stats.open_sessions == 0


DRAFTER = textwrap.dedent("""
    import sys, time
    from drafter.client import Step, VerifierClient
    with VerifierClient(sys.argv[1]) as client:
        sessions = [client.open_session(prompt_ids=[4, 5, i], max_new_tokens=500) for i in range(3)]
        print(" ".join(s.id for s in sessions), flush=True)
        positions = {s.id: s.position for s in sessions}
        while True:  # a drafter loop that never closes its sessions
            for s in sessions:
                outcome = client.step(Step(s.id, positions[s.id], draft_ids=(1, 2)))
                positions[s.id] = outcome.position
            time.sleep(0.01)
""")


def test_killed_client_process_slots_are_reaped(reaping, plain_decode):
    server, stub = reaping
    with Witnesses(stub, plain_decode):
        proc = subprocess.Popen([sys.executable, "-c", DRAFTER, server.address], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            ids = set(proc.stdout.readline().split())
            assert len(ids) == 3 and ids <= _live_ids(server)
            time.sleep(0.3)  # it steps for a while
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            killed = time.monotonic()
            _wait_gone(server, ids, IDLE_S + 2.0)
            assert time.monotonic() - killed < IDLE_S + 2.0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stats = stub.GetStats(rpc.GetStatsRequest())
    assert stats.free_slots == N_SLOTS and stats.open_sessions == 0  # the baseline: every slot free


def _health(channel):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_sigterm_with_steps_in_flight(reliability_checkpoint, plain_decode):
    drain_s = 1.5
    proc = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", str(reliability_checkpoint), "--port", "0",
                             "--n-slots", "6", "--max-seq-len", str(MAX_SEQ_LEN), "--max-k", str(MAX_K),
                             "--drain-s", str(drain_s), "--grace-s", "5"],
                            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, listening = [], threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                listening.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert listening.wait(120), "".join(lines)
        address = re.search(r"listening on (\S+)", "".join(lines)).group(1)
        with grpc.insecure_channel(address) as channel:
            stub = rpc.VerifierStub(channel)
            witnesses = Witnesses(stub, plain_decode, recycle=False)
            for w in witnesses.witnesses:
                w.pause_s = 0.03  # sessions last past the drain
            witnesses.__enter__()
            before = [w.steps for w in witnesses.witnesses]
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # inside the drain
            assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            refused = rpc_error(stub.OpenSession, rpc.OpenSessionRequest(prompt_ids=[1, 2], max_new_tokens=3), timeout=5)
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            during = [w.steps for w in witnesses.witnesses]
            assert proc.wait(timeout=60) == 0, "".join(lines)
            after = rpc_error(stub.GetModelInfo, rpc.GetModelInfoRequest(), timeout=5)
            assert after.code() == grpc.StatusCode.UNAVAILABLE
            witnesses._stop.set()
            for t in witnesses._threads:
                t.join(30)
            # steps kept running through the drain, every emitted token is plain decoding's, and
            # the only failure a witness saw is UNAVAILABLE once the port closed
            assert any(w.steps > d for w, d in zip(witnesses.witnesses, during)), (before, during)
            for w in witnesses.witnesses:
                w.check(allowed=(grpc.StatusCode.UNAVAILABLE,))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
