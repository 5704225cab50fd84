"""`python -m verifier serve`, run as a user runs it: it logs its port, answers, and exits cleanly
on SIGTERM."""

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier import cli, rpc

REPO = Path(__file__).resolve().parents[2]


def test_serve_logs_its_port_answers_and_stops_on_sigterm(text_checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", str(text_checkpoint), "--port", "0",
                             "--n-slots", "2", "--max-seq-len", "64", "--max-k", "4", "--grace-s", "1"],
                            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    listening = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(120), "".join(lines)
        (line,) = [ln for ln in lines if "listening on" in ln]
        address = re.search(r"listening on (127\.0\.0\.1:(\d+))", line).group(1)
        assert int(address.split(":")[1]) > 0
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = rpc.VerifierStub(channel)
            assert stub.GetModelInfo(rpc.GetModelInfoRequest(), timeout=10).max_context == 64
            opened = stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=[1, 2, 3], max_new_tokens=4), timeout=10)
            assert opened.position == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        reader.join(timeout=10)
        assert any("stopped" in ln for ln in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_rejects_bad_options(capsys, text_checkpoint):
    assert cli.main(["serve", "--model", str(text_checkpoint), "--port", "0", "--tls-cert", "cert.pem"]) == 2
    assert "tls_cert and tls_key" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(text_checkpoint), "--port", "0", "--max-wait-ms", "-1"]) == 2
    assert "max_wait_ms" in capsys.readouterr().err
