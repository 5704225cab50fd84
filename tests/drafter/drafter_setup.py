"""What the drafter tests serve, and the fixtures that serve it.

Test files import these fixtures by name: a conftest.py here would be imported as a top-level
`conftest` module (this folder is not a package, so that it cannot shadow the real `drafter`
package) and hide tests/conftest.py from the test files that import from it.
"""

import shutil

import pytest

from verifier.tokenizer import byte_level_tokenizer

NAME = "qwen3_5_text"
MAX_SEQ_LEN, MAX_K = 96, 8


@pytest.fixture(scope="module")
def served_checkpoint(hf_checkpoint, tmp_path_factory):
    """The tiny qwen3_5_text checkpoint with a byte-level tokenizer.json beside it (its vocabulary of
    90 ids covers ASCII up to 'Y'), so the server takes --text prompts and the CLI can print text."""
    path = shutil.copytree(hf_checkpoint(NAME), tmp_path_factory.mktemp("served") / NAME)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def server(served_checkpoint):
    from verifier.server.testing import LoopbackServer

    with LoopbackServer(served_checkpoint, n_slots=6, max_seq_len=MAX_SEQ_LEN, max_k=MAX_K) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    """A blocking client of the loopback server."""
    from drafter.client import VerifierClient

    with VerifierClient(server.address, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def target(load_target):
    """The served checkpoint's model, loaded in this process: plain decoding to compare against."""
    return load_target(NAME)


def plain_in_process(model, prompt: list[int], max_new_tokens: int, sampling=None, max_k: int = 0, proposer=None, k: int = 0):
    """In-process generation on an engine shaped like the loopback server's slot (max_seq_len
    MAX_SEQ_LEN): plain decoding by default, or speculative with `proposer` and `k`."""
    from verifier.engine import Engine
    from verifier.generate import generate

    return generate(Engine(model, 1, MAX_SEQ_LEN, max_k=max_k), prompt, max_new_tokens, sampling, proposer, k)
