"""Bearer-token auth and TLS, from the drafter's side: the client sends the token and trusts the
given root certificate; the CLI reports a refused token with exit status 1."""

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from drafter.client import RetryPolicy, VerifierClient, VerifierError
from drafter.loop import generate
from verifier.proposers import RandomProposer

from drafter_setup import MAX_SEQ_LEN, served_checkpoint  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]


def test_the_token_opens_the_door_and_its_absence_does_not(served_checkpoint, tmp_path):
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(served_checkpoint, n_slots=1, max_seq_len=MAX_SEQ_LEN, max_k=4, auth_token="s3cret") as server:
        with VerifierClient(server.address, auth_token="s3cret") as client:
            got = generate(client, RandomProposer(90, seed=1), prompt_ids=[4, 5, 6], max_new_tokens=6, k=3)
            assert len(got.tokens) == 6
        for token in (None, "wrong"):
            with VerifierClient(server.address, auth_token=token) as client, pytest.raises(VerifierError) as info:
                client.model_info()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        command = [sys.executable, "-m", "drafter", "generate", "--server", server.address, "--prompt-ids", "4,5", "--max-new-tokens", "3"]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120,
                              env={**os.environ, "VERIFIER_AUTH_TOKEN": "wrong"})
        assert proc.returncode == 1 and proc.stderr.startswith("error: UNAUTHENTICATED"), proc.stderr
        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
        proc = subprocess.run([*command, "--auth-token-file", str(token_file)], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr
        # on the command line it still works, with a warning that the process list shows it
        proc = subprocess.run([*command, "--auth-token", "s3cret"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0 and proc.stderr.startswith("warning: --auth-token shows in the process list"), proc.stderr


def test_tls_with_the_servers_root_certificate(served_checkpoint, self_signed, tmp_path):
    from verifier.server.testing import LoopbackServer

    cert, key = self_signed
    with LoopbackServer(served_checkpoint, n_slots=1, max_seq_len=MAX_SEQ_LEN, max_k=4, tls_cert=cert, tls_key=key) as server:
        with VerifierClient(server.address, tls_root_cert=cert) as client:
            assert client.model_info().vocab_size == 90
        with VerifierClient(server.address, timeout_s=5, retry=RetryPolicy(attempts=1)) as plaintext, pytest.raises(VerifierError) as info:
            plaintext.model_info()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="tls_root_cert"):
        VerifierClient("127.0.0.1:1", tls_root_cert=tmp_path / "missing.pem")
