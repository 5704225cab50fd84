"""A client in another language: Node.js with @grpc/grpc-js and @grpc/proto-loader loading
proto/verifier/v1/verifier.proto as is (tests/service/node_client/client.js) opens sessions and steps them
with drafts over unary Verify calls and over a VerifyStream; both streams equal plain decoding.
Skips, saying why, where node or npm is missing or the packages cannot be installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from verifier.server.testing import LoopbackServer

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("@grpc/grpc-js@1", "@grpc/proto-loader@0.7")
MODULES = Path(os.environ.get("VERIFIER_NODE_MODULES", Path.home() / ".cache" / "verifier-node-client"))


@pytest.fixture(scope="module")
def node_modules():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node.js client test")
    if not (MODULES / "node_modules" / "@grpc" / "grpc-js").is_dir():
        MODULES.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(MODULES), *PACKAGES],
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {' '.join(PACKAGES)} took over 300 s")
        if done.returncode != 0:
            pytest.skip(f"npm install {' '.join(PACKAGES)} failed (no registry?): {done.stderr.strip().splitlines()[-1:]}")
    return MODULES / "node_modules"


def test_a_node_client_gets_plain_decoding(node_modules, text_checkpoint, plain):
    prompt, max_new = [5, 17, 33, 2], 24
    expected = plain(prompt, max_new).tokens
    with LoopbackServer(text_checkpoint, n_slots=4, max_seq_len=96, max_k=8) as server:
        args = json.dumps({"prompt": prompt, "maxNew": max_new, "hint": expected, "vocab": 90})
        done = subprocess.run(["node", str(Path(__file__).parent / "node_client" / "client.js"), server.address,
                               str(ROOT / "proto" / "verifier" / "v1" / "verifier.proto"), args],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "NODE_PATH": str(node_modules)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["unary"] == list(expected) and got["stream"] == list(expected)
