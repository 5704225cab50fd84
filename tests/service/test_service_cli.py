"""`python -m verifier serve`, run as a user runs it: it logs its port, answers, and exits cleanly
on SIGTERM; its flags are ServerConfig's fields; a port it cannot bind is one line and exit 2."""

import argparse
import dataclasses
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier import cli, rpc
from verifier.server import ServerConfig
from verifier.server.cli import add_serve_parser, config_from_args, flag_name

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


@pytest.mark.parametrize("gap_s", [0.0, 0.05, 0.3])
def test_a_second_sigterm_soon_after_the_first_exits_0_or_130_never_143(text_checkpoint, gap_s):
    """With the default drain and grace the shutdown is quick, so a second SIGTERM may come while it
    runs (130: stopped at once) or after it, while the process exits (130 too, or 0 if the process
    is gone first): never 143, the status of a SIGTERM no handler took."""
    proc = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", str(text_checkpoint), "--port", "0",
                             "--n-slots", "2", "--max-seq-len", "64"],
                            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:
            if "listening on" in line:
                break
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_signal_stops_at_once_and_the_wait_is_said(text_checkpoint):
    """The first SIGINT says how long the shutdown may take (here a 60 s drain); a second one ends
    the process at once, exit 130."""
    proc = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", str(text_checkpoint), "--port", "0",
                             "--n-slots", "2", "--max-seq-len", "64", "--drain-s", "60", "--grace-s", "5"],
                            cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    listening, stopping = threading.Event(), threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            listening.set() if "listening on" in line else None
            stopping.set() if line.startswith("stopping:") else None

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert listening.wait(120), "".join(lines)
        proc.send_signal(signal.SIGINT)
        assert stopping.wait(30), "".join(lines)
        (said,) = [ln for ln in lines if ln.startswith("stopping:")]
        assert "60 s with health NOT_SERVING" in said and "up to 5 s for calls in flight" in said and "second Ctrl-C" in said
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
        assert time.monotonic() - start < 20
        reader.join(timeout=10)
        assert any(ln.startswith("stopping at once") for ln in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_rejects_bad_options(capsys, text_checkpoint):
    assert cli.main(["serve", "--model", str(text_checkpoint), "--port", "0", "--tls-cert", "cert.pem"]) == 2
    assert "tls_cert and tls_key" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(text_checkpoint), "--port", "0", "--max-wait-ms", "-1"]) == 2
    assert "max_wait_ms" in capsys.readouterr().err


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verifier")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser


def test_every_config_field_is_a_flag_with_the_fields_default():
    (serve,) = [a for a in _serve_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = {a.dest: a for a in serve.choices["serve"]._actions}
    for spec in dataclasses.fields(ServerConfig):
        action = actions[spec.name]
        assert flag_name(spec) in action.option_strings
        assert "(default: " in action.help or action.required, action.help
        if spec.default is dataclasses.MISSING:
            assert action.default is None
        else:
            assert action.default == spec.default and f"(default: {spec.default})" in action.help, spec.name
    assert actions["model_dir"].option_strings == ["--model"] and actions["port"].required
    assert ServerConfig.__dataclass_fields__["idle_timeout_s"].default == 600.0  # finite: nothing holds a slot forever
    assert ServerConfig.__dataclass_fields__["results_per_session"].default == 8


def test_flags_build_the_config(text_checkpoint):
    args = _serve_parser().parse_args(["serve", "--model", str(text_checkpoint), "--port", "0", "--results-per-session", "3",
                                       "--idle-timeout-s", "30", "--metrics-port", "9100", "--rollback", "snapshot"])
    assert config_from_args(args) == ServerConfig(text_checkpoint, port=0, results_per_session=3, idle_timeout_s=30.0,
                                                  metrics_port=9100, rollback="snapshot")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_busy_port_is_one_line_and_exit_2(text_checkpoint, flag):
    """A port another process holds: our one line naming the flag, without gRPC's own log line
    before it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = ["--port", str(port)] if flag == "--port" else ["--port", "0", "--metrics-port", str(port)]
        proc = subprocess.run([sys.executable, "-m", "verifier", "serve", "--model", str(text_checkpoint), "--host", "127.0.0.1",
                               *ports], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"127.0.0.1:{port}" in line and flag in line, proc.stderr
