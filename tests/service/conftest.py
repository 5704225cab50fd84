import shutil

import grpc
import pytest

from verifier import rpc
from verifier.tokenizer import byte_level_tokenizer

NAME = "qwen3_5_text"


@pytest.fixture(scope="session")
def text_checkpoint(hf_checkpoint, tmp_path_factory):
    """The tiny qwen3_5_text checkpoint with a byte-level tokenizer.json (its 90 ids cover ASCII up to 'Y')."""
    path = shutil.copytree(hf_checkpoint(NAME), tmp_path_factory.mktemp("service") / NAME)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def server(text_checkpoint):
    """A loopback server shared by a module's tests (they use their own sessions)."""
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(text_checkpoint, n_slots=24, max_seq_len=96, max_k=8) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield rpc.VerifierStub(channel)


@pytest.fixture(scope="module")
def plain(text_checkpoint):
    """plain(prompt, n, sampling=None) -> the in-process plain (K = 0) Generation on a separate engine."""
    from verifier.engine import Engine
    from verifier.generate import generate
    from verifier.model import load_model

    engine = Engine(load_model(text_checkpoint), n_slots=1, max_seq_len=96, max_k=0)
    cache = {}

    def run(prompt, n, sampling=None):
        key = (tuple(prompt), n, sampling)
        if key not in cache:
            cache[key] = generate(engine, list(prompt), n, sampling)
        return cache[key]

    return run
